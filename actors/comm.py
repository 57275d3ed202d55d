"""Point-to-point and data-parallel collectives between pipeline actors.

Built on ``torch.distributed`` process groups (gloo on CPU, NCCL on GPU), formed
once per pipeline: one world group for activations and gradients, and one group
per pipeline rank across its data-parallel replicas.  Every operation carries the
group's timeout, so a dead or hung peer becomes an error, never a hang.

Note [staged transport]
NCCL refuses two ranks on one GPU, so actors that share a GPU talk over gloo, which moves
host memory: each tensor is *staged*.  A send copies it into a pinned host buffer
(non-blocking, an event recorded after the copy; a sender thread waits for that event and
hands the buffer to gloo's isend, so the actor goes on queueing kernels:
actors/staging.py); a receive lands in a pinned host buffer and goes to the device with a
non-blocking copy (the pinned allocator keeps the buffer until that copy is done).
All-reduces stage the flat bucket the same way (waiting for its copy's event: the result
is needed at once) and copy the result straight back into the bucket.  ``wire`` is where
tensors travel (the device for NCCL, the CPU for gloo); ``device`` is where the actor
computes.  ``staged=True`` also stages when both are the CPU (a private copy each way,
sent from the sender thread too), which runs this path without a GPU.
"""

from __future__ import annotations

import datetime
import socket
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .pair_queues import PairQueues
from .staging import StagedSender
from .values import HEADER_BYTES, TensorMeta, dtype_of

__all__ = ["Communicator", "free_address", "node_ip", "bucket_tensors"]


def node_ip() -> str:
    """This node's IP, as Ray knows it (outside Ray, in unit tests: the hostname's)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - outside Ray the hostname's address will do
        return socket.gethostbyname(socket.gethostname())


def free_address() -> tuple[str, int]:
    """This node's IP and a free TCP port, for the group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return node_ip(), s.getsockname()[1]


class Communicator:
    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        address: tuple[str, int],
        backend: str,
        timeout_s: float,
        dp_groups: list[list[int]],
        device: torch.device,
        tie_groups: Sequence[Sequence[int]] = (),
        staged: bool = False,
        queued: bool = False,
        tp_groups: Sequence[Sequence[int]] = (),
    ) -> None:
        self.rank, self.device, self.backend = rank, device, backend
        self.wire = device if backend == "nccl" else torch.device("cpu")  # Note [staged transport]
        self.staged = staged or self.wire != device
        self._pin = self.staged and device.type == "cuda"
        # Note [NCCL order] in schedules/posting.py: each pair's operations run in posted order;
        # ``queued`` runs them so on gloo (Note [NCCL order on the CPU] in actors/pair_queues.py).
        self.ordered = backend == "nccl" or queued
        self._queues = PairQueues() if queued else None
        # Staged sends go out from one thread once copied (actors/staging.py); in NCCL's order, posted here.
        self._sender = StagedSender(self._isend) if self.staged and not queued else None
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address[0]}:{address[1]}",
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=timeout_s),
            device_id=device if backend == "nccl" else None,  # NCCL binds its communicators to this GPU
        )
        self.dp_group = None
        self.dp_size = 1
        for ranks in dp_groups:  # every process creates every group, in the same order
            group = dist.new_group(ranks, backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                self.dp_group, self.dp_size = group, len(ranks)
        # Note [tie reduction] in schedules/passes.py: one group per tie and replica, by index.
        self.tie_groups = [dist.new_group(list(ranks), backend=backend) for ranks in tie_groups]
        self.tp_group = None  # the stage's own collectives (Note [tensor parallelism] in actors/tensor_parallel.py)
        for ranks in tp_groups:
            group = dist.new_group(list(ranks), backend=backend) if len(ranks) > 1 else None
            if rank in ranks:
                self.tp_group = group
        self._mesh = None
        self._pending: list = []

    @property
    def tp_mesh(self):
        """The DeviceMesh over this actor's TP group (made once, when a plan first needs it)."""
        if self._mesh is None:
            if self.tp_group is None:
                raise RuntimeError("this actor has no TP group (tp=1): a tensor-parallel plan cannot apply")
            from .tensor_parallel import tp_mesh

            self._mesh = tp_mesh(self.tp_group, self.device)
        return self._mesh

    # -- staging (Note [staged transport]) ----------------------------------------------------
    def to_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` as they travel: themselves, or staged copies in (pinned) host memory."""
        out, ready = self._stage(tensors)
        if ready is not None:
            ready.synchronize()  # gloo reads the buffers next: wait for these copies, not the whole stream
        return out

    def _stage(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], Optional[torch.cuda.Event]]:
        """Staged copies and the event after their device-to-host copy (None: done already)."""
        tensors = [t.detach().contiguous() for t in tensors]
        if not self.staged:
            return tensors, None
        out = [torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin) for t in tensors]
        for host, t in zip(out, tensors):
            host.copy_(t, non_blocking=self._pin)
        if not self._pin:
            return out, None
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        return out, ready

    def _buffer(self, shape, dtype: str) -> torch.Tensor:
        if self.staged:
            return torch.empty(shape, dtype=dtype_of(dtype), pin_memory=self._pin)
        return torch.empty(shape, dtype=dtype_of(dtype), device=self.device)

    def from_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        if not self.staged:
            return tensors
        return [t.to(self.device, non_blocking=self._pin, copy=True) for t in tensors]

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Asynchronous send; completion is awaited by ``flush`` (see Note [deadlock-free ordering])."""
        if self._sender is None:
            for t in self.to_wire(tensors):
                self._pending.append((self._isend(t, dst), t))
            return
        buffers, ready = self._stage(tensors)  # Note [staged transport]: the sender thread waits for the copy
        self._pending += [(self._sender.send(ready, t, dst), t) for t in buffers]

    def _isend(self, t: torch.Tensor, dst: int):
        return dist.isend(t, dst) if self._queues is None else self._queues.isend(t, dst)

    def _irecv(self, t: torch.Tensor, src: int):
        return dist.irecv(t, src) if self._queues is None else self._queues.irecv(t, src)

    def recv(self, metas: list[TensorMeta], src: int) -> list[torch.Tensor]:
        out = []
        for shape, dtype in metas:
            t = self._buffer(shape, dtype)
            self._irecv(t, src).wait()
            out.append(t)
        return self.from_wire(out)

    def irecv(self, metas: list[TensorMeta], src: int) -> tuple[list, list[torch.Tensor]]:
        """Post receives now (the transfer proceeds while this rank computes); ``wait_recv`` later."""
        tensors = [self._buffer(shape, dtype) for shape, dtype in metas]
        return [self._irecv(t, src) for t in tensors], tensors

    def wait_recv(self, handle: tuple[list, list[torch.Tensor]]) -> list[torch.Tensor]:
        works, tensors = handle
        for w in works:
            w.wait()
        return self.from_wire(tensors)

    def arrived(self, handle: tuple[list, list[torch.Tensor]]) -> bool:
        """Whether a posted receive has completed, asked without waiting.  Gloo's works
        learn that only inside ``wait()``: on gloo this says False (cannot tell)."""
        return (self.backend != "gloo" or self.ordered) and all(w.is_completed() for w in handle[0])

    def send_header(self, header: torch.Tensor, dst: int) -> None:
        t = header.to(self.wire)
        work = self._isend(t, dst) if self._sender is None else self._sender.send(None, t, dst)  # in posted order
        self._pending.append((work, t))

    def recv_header(self, src: int) -> torch.Tensor:
        t = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.wire)
        self._irecv(t, src).wait()
        return t.cpu()

    def flush(self) -> None:
        """Wait for every outstanding send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            work.wait()

    # -- data parallel -----------------------------------------------------------------------
    def allreduce_mean(self, tensors: list[torch.Tensor], bucket_bytes: int) -> int:
        """Average ``tensors`` in place across this rank's data-parallel replicas.

        Tensors are packed into flat buckets of at most ``bucket_bytes`` (0: one
        message per tensor) so an all-reduce is a few large messages.  Every replica
        passes the same tensors in the same order (the same stage's parameters), so
        the buckets match.  Returns the number of all-reduce messages issued.
        """
        if self.dp_group is None or not tensors:
            return 0
        buckets = bucket_tensors(tensors, bucket_bytes)
        for bucket in buckets:
            single = len(bucket) == 1 and bucket[0].is_contiguous() and not self.staged
            flat = bucket[0] if single else torch.cat([t.reshape(-1) for t in bucket])
            self._all_reduce(flat, self.dp_group)
            flat.div_(self.dp_size)
            if single:
                continue
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
        return len(buckets)

    def allreduce_sum(self, tensors: list[torch.Tensor], group_index: int, bucket_bytes: int) -> None:
        """Sum ``tensors`` in place over tie group ``group_index`` (every member passes the
        same tensors in the same order)."""
        for bucket in bucket_tensors(tensors, bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self._all_reduce(flat, self.tie_groups[group_index])
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every actor of the pipeline (a MIN all-reduce over the world)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.wire)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def _all_reduce(self, flat: torch.Tensor, group) -> None:
        """Sum ``flat`` in place over ``group``, through host memory when staged."""
        if not self.staged:
            dist.all_reduce(flat, group=group)
            return
        (host,) = self.to_wire([flat])
        dist.all_reduce(host, group=group)
        flat.copy_(host, non_blocking=self._pin)  # straight from the pinned buffer: no second device buffer

    def close(self) -> None:
        if self._queues is not None:
            self._queues.close()
        if self._sender is not None:
            self._sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def bucket_tensors(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_bytes``
    together; a tensor larger than that travels alone."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        head = buckets[-1][0] if buckets else None
        fits = (head is not None and head.dtype == t.dtype and head.device == t.device
                and size + nbytes <= bucket_bytes)
        if fits:
            buckets[-1].append(t)
            size += nbytes
        else:
            buckets.append([t])
            size = nbytes
    return buckets

