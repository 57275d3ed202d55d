"""How an actor's point-to-point messages move: one interface (``Transport``: send, receive,
wait, abort, the time spent blocked), one class per way, chosen once when the Communicator
(actors/comm.py) is built, by the controller's choice (``transport=``, mpmd/runtime/transport.py):

* ``GlooTransport`` (``"gloo"``): gloo on the CPU, every message on the world group;
* ``StagedTransport`` (``"staged"``): gloo through host memory, sent from a sender thread
  (Note [staged transport] in actors/staging.py): actors sharing a GPU, or the CPU on request;
* ``NcclTransport`` (``"nccl"``): NCCL, each pair's messages on its own group (Note
  [point-to-point groups] in actors/comm.py), in posted order, each watched here;
* ``NcclOrderTransport`` (``"nccl-order"``): NCCL's order run over gloo (Note [NCCL order on
  the CPU] in actors/pair_queues.py), watched the same way.

Where tensors travel (the device, or host memory) is the transport's ``Staging``.

Note [stuck operations]
A send or receive whose peer never comes holds an NCCL kernel on the GPU; NCCL's watchdog
notices only at the group's timeout, counted from when the operation was enqueued, and then
takes the whole process down (the user sees an actor die, not which operation).  So in
NCCL's order (``ordered``: NCCL and its CPU emulation) this actor waits for each operation
itself, polling ``is_completed`` for at most ``comm_timeout_s`` from when it starts waiting
(plus ``FIRST_STEP_S`` in a program's first step, when NCCL connects each pair's channels and
``torch.compile`` compiles), then aborts its communicators and raises ``CommTimeout``, which
the worker reports as a failure of the instruction that waited.  The point-to-point groups'
own timeout, NCCL's watchdog, is set ``WATCHDOG_MARGIN_S`` after that, so it fires only if
this actor could not act.  The collectives are not watched here: the world group's (the
agreed update's) watchdog fires at ``comm_timeout_s + FIRST_STEP_S`` (the first step's
allowance: a peer may be compiling), the data-parallel, tie and tensor-parallel groups'
at torch's default (ten minutes on NCCL), and the controller's ``step_timeout_s`` bounds
them all.  On gloo an operation's own timeout raises.
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .pair_queues import PairQueues
from .staging import Staging, StagedSender, staging_for
from .values import HEADER_BYTES, TensorMeta

__all__ = ["Transport", "GlooTransport", "StagedTransport", "OrderedTransport", "NcclTransport",
           "NcclOrderTransport", "TRANSPORTS", "transport_kind", "select_transport", "CommTimeout", "FIRST_STEP_S",
           "WATCHDOG_MARGIN_S"]

# Note [stuck operations]: the extra patience of a program's first step (NCCL connects a pair's
# channels at its first message; torch.compile compiles), and how much later than that NCCL's
# own watchdog (which takes the process down) fires.
FIRST_STEP_S = 300.0
WATCHDOG_MARGIN_S = 600.0


class CommTimeout(RuntimeError):
    """A point-to-point operation that did not complete within the deadline (Note [stuck operations])."""


class Transport:
    """Point-to-point messages between this actor and its peers.  Sends are asynchronous and
    awaited by ``flush`` (Note [deadlock-free ordering]); receives land in the staging's buffers.
    What the class says before the process groups exist: their ``backend``, the world group's
    timeout, the device NCCL binds to, and which pairs need groups of their own."""

    backend = ""  # the process groups' torch.distributed backend
    ordered = False  # each pair's operations run in posted order (Note [NCCL order] in schedules/posting.py)

    def __init__(self, staging: Staging, *, rank: int, timeout_s: float, pairs: dict) -> None:
        """``rank``: this actor; ``timeout_s``: ``comm_timeout_s``; ``pairs``: peer -> the group its
        messages travel on (Note [point-to-point groups]; empty where the world group serves)."""
        self.staging = staging
        self._pending: list = []  # (work, tensor) of the sends not yet awaited
        self.blocked_ns = 0  # time spent waiting for point-to-point operations to complete (``_finish``)
        self.first_step = False  # a program's first step: more patience (Note [stuck operations])
        self.aborted = False  # this actor's NCCL communicators were aborted

    @staticmethod
    def world_timeout_s(comm_timeout_s: float) -> float:
        """The world group's timeout (gloo's own raises)."""
        return comm_timeout_s

    @staticmethod
    def bound_device(device: torch.device) -> Optional[torch.device]:
        """The device the world group binds its communicators to (None: none)."""
        return None

    @staticmethod
    def pair_groups(p2p_groups: Sequence[Sequence[int]]) -> Sequence[Sequence[int]]:
        """The two-actor groups to form: none, gloo matches by peer and tag on the world group."""
        return ()

    # -- sends --------------------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Asynchronous send; completion is awaited by ``flush``."""
        for t in self.staging.to_wire(tensors):
            self._pending.append((self._isend(t, dst), t))

    def send_header(self, header: torch.Tensor, dst: int) -> None:
        t = header.to(self.staging.wire)
        self._pending.append((self._isend(t, dst), t))

    def flush(self) -> None:
        """Wait for every outstanding send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._finish(work, "a send of this step")

    # -- receives -----------------------------------------------------------------------------
    def recv(self, metas: list[TensorMeta], src: int) -> list[torch.Tensor]:
        out = []
        for shape, dtype in metas:
            t = self.staging.buffer(shape, dtype)
            self._finish(self._irecv(t, src), f"a receive from actor {src}")
            out.append(t)
        return self.staging.from_wire(out)

    def recv_header(self, src: int) -> torch.Tensor:
        t = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.staging.wire)
        self._finish(self._irecv(t, src), f"a shape header from actor {src}")
        return t.cpu()

    def irecv(self, metas: list[TensorMeta], src: int) -> tuple[list, list[torch.Tensor]]:
        """Post receives now (the transfer proceeds while this rank computes); ``wait_recv`` later."""
        tensors = [self.staging.buffer(shape, dtype) for shape, dtype in metas]
        return [self._irecv(t, src) for t in tensors], tensors

    def wait_recv(self, handle: tuple[list, list[torch.Tensor]], src: int = -1) -> list[torch.Tensor]:
        works, tensors = handle
        for w in works:
            self._finish(w, f"a receive from actor {src}" if src >= 0 else "a receive")
        return self.staging.from_wire(tensors)

    def arrived(self, handle: tuple[list, list[torch.Tensor]]) -> bool:
        """Whether a posted receive has completed, asked without waiting.  Gloo's works learn
        that only inside ``wait()``: here False (cannot tell)."""
        return False

    # -- waiting, and the end -----------------------------------------------------------------
    def _finish(self, work, what: str) -> None:
        """Wait for ``work``; the time it takes adds to ``blocked_ns`` (Note [where a step goes]
        in mpmd/profiler/split.py)."""
        t0 = time.perf_counter_ns()
        try:
            self._await(work, what)
        finally:
            self.blocked_ns += time.perf_counter_ns() - t0

    def _await(self, work, what: str) -> None:
        work.wait()  # gloo's own timeout raises

    def _isend(self, t: torch.Tensor, dst: int):
        raise NotImplementedError

    def _irecv(self, t: torch.Tensor, src: int):
        raise NotImplementedError

    def abort(self) -> None:
        """Abort this actor's NCCL communicators, so no kernel stays stuck on the GPU (none here)."""

    def close(self) -> None:
        """Stop what this transport runs beside the actor (its threads)."""


class GlooTransport(Transport):
    """Gloo, tensors where they are computed (the CPU): every message on the world group."""

    backend = "gloo"

    def _isend(self, t, dst):
        return dist.isend(t, dst)

    def _irecv(self, t, src):
        return dist.irecv(t, src)


class StagedTransport(GlooTransport):
    """Gloo through host memory (Note [staged transport] in actors/staging.py): each send is
    copied out and issued by the sender thread once its copy is done, shape headers too, so
    each peer gets its messages in posted order."""

    def __init__(self, staging: Staging, *, rank: int, timeout_s: float, pairs: dict) -> None:
        super().__init__(staging, rank=rank, timeout_s=timeout_s, pairs=pairs)
        self._sender = StagedSender(self._isend)

    def send(self, tensors, dst) -> None:
        buffers, ready = self.staging.stage(tensors)  # the sender thread waits for the copy
        self._pending += [(self._sender.send(ready, t, dst), t) for t in buffers]

    def send_header(self, header, dst) -> None:
        t = header.to(self.staging.wire)
        self._pending.append((self._sender.send(None, t, dst), t))  # in posted order with the data

    def close(self) -> None:
        self._sender.close()


class OrderedTransport(Transport):
    """NCCL's order (Note [NCCL order] in schedules/posting.py): each pair's messages on the
    pair's own group, run in posted order, each awaited for at most the deadline (Note [stuck
    operations])."""

    ordered = True

    def __init__(self, staging: Staging, *, rank: int, timeout_s: float, pairs: dict) -> None:
        super().__init__(staging, rank=rank, timeout_s=timeout_s, pairs=pairs)
        self.rank, self.timeout_s = rank, timeout_s
        self._pairs = pairs

    @staticmethod
    def world_timeout_s(comm_timeout_s: float) -> float:
        return comm_timeout_s + FIRST_STEP_S  # collectives: not watched here

    @staticmethod
    def pair_groups(p2p_groups):
        return p2p_groups  # Note [point-to-point groups]

    def _pair(self, peer: int):
        """The group this actor's messages with ``peer`` travel on (Note [point-to-point groups])."""
        if peer not in self._pairs:
            raise RuntimeError(f"actor {self.rank} has no point-to-point group with actor {peer}: the schedule "
                               f"links ranks the pipeline did not link when it started (Note [point-to-point groups])")
        return self._pairs[peer]

    def arrived(self, handle) -> bool:
        return all(w.is_completed() for w in handle[0])

    def _await(self, work, what: str) -> None:
        patience = self.timeout_s + (FIRST_STEP_S if self.first_step else 0.0)
        deadline = time.monotonic() + patience
        pause = 1e-5
        while not work.is_completed():
            if time.monotonic() > deadline:
                self.abort()
                raise CommTimeout(f"{what} did not complete within {patience:.0f}s (comm_timeout_s"
                                  f"{' + the first step allowance' if self.first_step else ''}): the peer never posted "
                                  f"its side, or is stuck; this actor's communicators were aborted")
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        work.wait()  # orders this stream after it on the GPU; raises the operation's error


class NcclTransport(OrderedTransport):
    """NCCL between actors with a GPU each; a stuck operation aborts the communicators."""

    backend = "nccl"

    @staticmethod
    def bound_device(device):
        return device  # NCCL binds its communicators to this GPU (Note [point-to-point groups])

    def _isend(self, t, dst):
        return dist.isend(t, dst, group=self._pair(dst))

    def _irecv(self, t, src):
        return dist.irecv(t, src, group=self._pair(src))

    def abort(self) -> None:
        if self.aborted or not dist.is_initialized():
            return
        self.aborted = True
        dist.distributed_c10d._abort_process_group()


class NcclOrderTransport(OrderedTransport):
    """NCCL's order over gloo, one queue per pair's group (Note [NCCL order on the CPU] in
    actors/pair_queues.py); a stuck operation ends at the group's timeout (nothing to abort)."""

    backend = "gloo"

    def __init__(self, staging: Staging, *, rank: int, timeout_s: float, pairs: dict) -> None:
        super().__init__(staging, rank=rank, timeout_s=timeout_s, pairs=pairs)
        self._queues = PairQueues()

    def _isend(self, t, dst):
        return self._queues.isend(t, dst, self._pair(dst))

    def _irecv(self, t, src):
        return self._queues.irecv(t, src, self._pair(src))

    def close(self) -> None:
        self._queues.close()


TRANSPORTS: dict[str, type[Transport]] = {"gloo": GlooTransport, "staged": StagedTransport, "nccl": NcclTransport,
                                          "nccl-order": NcclOrderTransport}


def transport_kind(backend: str, *, staged: bool, queued: bool) -> str:
    """The name in ``TRANSPORTS`` of the controller's choice (``Transport`` in mpmd/runtime/transport.py)."""
    if backend == "nccl":
        if staged or queued:
            raise ValueError("NCCL moves device memory in its own order: 'staged' and 'queued' are gloo's")
        return "nccl"
    if backend != "gloo":
        raise ValueError(f"unknown backend {backend!r}: the transports run on 'gloo' or 'nccl'")
    return "nccl-order" if queued else "staged" if staged else "gloo"


def select_transport(backend: str, *, staged: bool, queued: bool,
                  device: torch.device) -> tuple[type[Transport], Staging]:
    """The transport class and the staging an actor computing on ``device`` uses (gloo stages
    a GPU's tensors whatever ``staged`` says: Note [staged transport])."""
    staging = staging_for(backend, staged, device)
    return TRANSPORTS[transport_kind(backend, staged=staging.staged, queued=queued)], staging
