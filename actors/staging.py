"""Where an actor's tensors travel, and how they get there: on the device itself, or staged
through host memory (``Staging``); and staged sends without stopping the actor (``StagedSender``).

Note [staged transport]
NCCL refuses two ranks on one GPU, so actors that share a GPU talk over gloo, which moves
host memory: each tensor is *staged*.  A send copies it into a pinned host buffer
(non-blocking, an event recorded after the copy; a sender thread waits for that event and
hands the buffer to gloo's isend, so the actor goes on queueing kernels: ``StagedSender``
below); a receive lands in a pinned host buffer and goes to the device with a
non-blocking copy (the pinned allocator keeps the buffer until that copy is done).
All-reduces stage the flat bucket the same way (waiting for its copy's event: the result
is needed at once) and copy the result straight back into the bucket.  ``wire`` is where
tensors travel (the device for NCCL, the CPU for gloo); ``device`` is where the actor
computes.  ``staged=True`` also stages when both are the CPU (a private copy each way,
sent from the sender thread too: ``HostCopies``), which runs this path without a GPU.
The transports (actors/transports.py) move what a ``Staging`` gives them; the
Communicator's collectives (actors/comm.py) and ZeRO's (actors/zero.py) go through it too.

Staged sends without stopping the actor: a staged send copies the tensor into pinned host
memory with a non-blocking copy and records an event after it; gloo must not read the buffer
before that event.  Waiting on the actor's thread would stop it queueing the next kernels
(the next microbatch's forward) until the copy is done, once per message.  Instead one
sender thread per actor takes the buffers in posted order, waits for each one's event and
hands it to gloo's ``isend``; the actor's thread goes on at once.  Every staged send of the
actor (shape headers too) goes through the thread, so each peer still gets its messages in
posted order.  ``flush`` waits for what the thread issued (``DeferredWork.wait``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .buckets import PendingMean
from .values import dtype_of

__all__ = ["Staging", "Unstaged", "HostCopies", "PinnedHostCopies", "staging_for", "StagedSender", "DeferredWork"]


class Staging:
    """How tensors get from where the actor computes (``device``) to where they travel
    (``wire``) and back, for point-to-point messages and collectives alike."""

    staged = False  # tensors travel as copies in host memory

    def __init__(self, wire: torch.device, device: torch.device) -> None:
        self.wire, self.device = wire, device

    def stage(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Optional[torch.cuda.Event]]:
        """``tensors`` as they travel, and the event after their copy (None: ready now)."""
        raise NotImplementedError

    def to_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` as they travel, ready to be read."""
        out, ready = self.stage(tensors)
        if ready is not None:
            ready.synchronize()  # gloo reads the buffers next: wait for these copies, not the whole stream
        return out

    def buffer(self, shape, dtype: str) -> torch.Tensor:
        """An empty tensor for a receive to land in."""
        raise NotImplementedError

    def from_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Received ``tensors`` where the actor computes."""
        raise NotImplementedError

    def all_reduce(self, flat: torch.Tensor, group) -> None:
        """Sum ``flat`` in place over ``group``."""
        raise NotImplementedError

    def start_mean(self, bucket: list[torch.Tensor], group, size: int) -> PendingMean:
        """Start averaging ``bucket`` in place over ``group`` (of ``size`` members), ``async_op``."""
        raise NotImplementedError

    def before_dtensor(self) -> None:
        """Make DTensor's collectives safe on this actor's groups (Note [gloo all-gathers of CUDA tensors])."""


def _detached(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().contiguous() for t in tensors]


class Unstaged(Staging):
    """Tensors travel where they are computed: NCCL on GPUs, gloo on the CPU."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device, device)

    def stage(self, tensors):
        return _detached(tensors), None

    def buffer(self, shape, dtype: str) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype_of(dtype), device=self.device)

    def from_wire(self, tensors):
        return tensors

    def all_reduce(self, flat, group) -> None:
        dist.all_reduce(flat, group=group)

    def start_mean(self, bucket, group, size: int) -> PendingMean:
        single = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if single else torch.cat([t.reshape(-1) for t in bucket])
        return PendingMean(dist.all_reduce(flat, group=group, async_op=True), bucket, flat, flat, size, False)


class HostCopies(Staging):
    """Gloo through host memory (Note [staged transport]): a private host copy each way; on the
    CPU (``transport="staged"``) this runs the shared-GPU path without a GPU."""

    staged = True
    pin = False  # copies through pinned memory, non-blocking (a GPU's: PinnedHostCopies)

    def __init__(self, device: torch.device) -> None:
        super().__init__(torch.device("cpu"), device)

    def stage(self, tensors):
        tensors = _detached(tensors)
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self.pin) for t in tensors]
        for host, t in zip(out, tensors):
            host.copy_(t, non_blocking=self.pin)
        return out, self._copied()

    def _copied(self) -> Optional[torch.cuda.Event]:
        """The event after the copies just queued (None: they are done)."""
        return None

    def buffer(self, shape, dtype: str) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype_of(dtype), pin_memory=self.pin)

    def from_wire(self, tensors):
        return [t.to(self.device, non_blocking=self.pin, copy=True) for t in tensors]

    def all_reduce(self, flat, group) -> None:
        (host,) = self.to_wire([flat])
        dist.all_reduce(host, group=group)
        flat.copy_(host, non_blocking=self.pin)  # straight from the pinned buffer: no second device buffer

    def start_mean(self, bucket, group, size: int) -> PendingMean:
        flat = torch.cat([t.reshape(-1) for t in bucket])
        (wire,) = self.to_wire([flat])
        return PendingMean(dist.all_reduce(wire, group=group, async_op=True), bucket, flat, wire, size, self.pin)


class PinnedHostCopies(HostCopies):
    """Actors sharing a GPU: copies through pinned host memory, non-blocking, each followed
    by an event (Note [staged transport])."""

    pin = True

    def _copied(self) -> torch.cuda.Event:
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return ready

    def before_dtensor(self) -> None:
        from .host_gather import gather_through_host

        gather_through_host("CUDA")  # Note [gloo all-gathers of CUDA tensors]


def staging_for(backend: str, staged: bool, device: torch.device) -> Staging:
    """Gloo moves host memory, so a GPU's tensors are staged on gloo; ``staged`` stages on the
    CPU too.  NCCL never stages."""
    if backend == "nccl":
        if staged:
            raise ValueError("NCCL moves device memory: a staged transport is gloo's")
        return Unstaged(device)
    if device.type == "cuda":
        return PinnedHostCopies(device)
    if staged or device.type != "cpu":
        return HostCopies(device)
    return Unstaged(device)


class DeferredWork:
    """A send the sender thread will issue; ``wait`` as a ``torch.distributed`` work."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._work: Any = None
        self._error: Optional[BaseException] = None

    def issued(self, work: Any = None, error: Optional[BaseException] = None) -> None:
        """Called by the sender thread: the send is out (``work``), or failed (``error``)."""
        self._work, self._error = work, error
        self._issued.set()

    def is_completed(self) -> bool:
        return self._issued.is_set() and (self._error is not None or self._work.is_completed())

    def wait(self) -> bool:
        self._issued.wait()
        if self._error is not None:
            raise RuntimeError(f"a staged send failed: {self._error}") from self._error
        return self._work.wait()


class StagedSender:
    """One thread issuing ``isend(tensor, dst)`` for staged buffers once their copy is done."""

    def __init__(self, isend: Callable[[torch.Tensor, int], Any]) -> None:
        self._isend = isend
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="staged-sender")
        self._thread.start()

    def send(self, ready: Any, tensor: torch.Tensor, dst: int) -> DeferredWork:
        """``ready``: the event recorded after the copy into ``tensor`` (None: already there)."""
        work = DeferredWork()
        self._queue.put((ready, tensor, dst, work))
        return work

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            ready, tensor, dst, work = item
            try:
                if ready is not None:
                    ready.synchronize()  # this thread waits for the copy, not the actor's
                work.issued(self._isend(tensor, dst))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the send
                work.issued(error=e)

    def close(self) -> None:
        self._queue.put(None)
