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

Note [point-to-point groups]
A process group given a device (``init_process_group(device_id=...)``, which makes NCCL
create its communicator eagerly, and every ``new_group`` after it) runs every unbatched
send and receive on that group's one communicator and CUDA stream, whichever the peer
(``ProcessGroupNCCL::pointToPoint``: "In eagerInit mode, reuse the parent comm.  Do not
lazily create p2p communicators"; torch warns that they "are thus serialized with all
other ops on this ProcessGroup, including other P2P ops").  On the world group an actor's
sends to the next rank would queue behind its receives from the previous one, a single
queue per rank, under which interleaved 1F1B hangs from its second step at 3 ranks or
more.  So in NCCL's order (``ordered``) every pair of actors that exchange messages
(``p2p_groups``: consecutive stages' ranks and the fed targets' ends, per replica and
TP rank, from ``schedules.linked_ranks``) gets a two-actor group of its own, created once
(eagerly, split from the world's communicator, in one order: Note [group formation] in
actors/group_plan.py): one stream per pair, both directions, exactly the model of Note [NCCL order] in
schedules/posting.py.  Without a device (lazy init) torch would make the same two-rank
communicators on first use, each a rendezvous of the pair in the middle of a step.  The
world group keeps the collectives.  Gloo matches by peer and tag on any group, so the
unordered transport sends on the world group.

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

import datetime
import socket
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from .buckets import PendingMean, bucket_tensors
from .group_plan import GroupKind, GroupPlan
from .groups import formation_for
from .pair_queues import PairQueues
from .staging import StagedSender
from .values import HEADER_BYTES, TensorMeta, dtype_of

__all__ = ["Communicator", "CommTimeout", "free_address", "node_ip", "FIRST_STEP_S", "WATCHDOG_MARGIN_S"]

# Note [stuck operations]: the extra patience of a program's first step (NCCL connects a pair's
# channels at its first message; torch.compile compiles), and how much later than that NCCL's
# own watchdog (which takes the process down) fires.
FIRST_STEP_S = 300.0
WATCHDOG_MARGIN_S = 600.0


class CommTimeout(RuntimeError):
    """A point-to-point operation that did not complete within the deadline (Note [stuck operations])."""


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
        p2p_groups: Sequence[Sequence[int]] = (),
        formation: Optional[str] = None,
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
        # Note [stuck operations]: in NCCL's order the operations are watched here; the group's own
        # timeout (NCCL's watchdog, the queued transport's gloo) comes well after.
        self.timeout_s, self.first_step = timeout_s, False
        self.aborted = False
        group_timeout = timeout_s + FIRST_STEP_S if self.ordered else timeout_s  # collectives: not watched here
        began, t0 = time.time(), time.perf_counter()
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address[0]}:{address[1]}",
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=group_timeout),
            device_id=device if backend == "nccl" else None,  # NCCL binds its communicators to this GPU
        )
        world_s = time.perf_counter() - t0
        # Note [group formation] in actors/group_plan.py: each actor forms only the groups it is in
        # (gloo), or every actor splits the world's communicator once per round (NCCL).
        pair_timeout = datetime.timedelta(seconds=timeout_s + FIRST_STEP_S + WATCHDOG_MARGIN_S)  # watched here first
        plan = GroupPlan.of(dp=dp_groups, tp=tp_groups, ties=tie_groups,
                            pairs=p2p_groups if self.ordered else ())  # Note [point-to-point groups]
        self.groups = formation_for(backend, formation).form(plan, rank, backend=backend,
                                                             timeouts={GroupKind.PAIR: pair_timeout})
        self.started = (began, world_s)  # wall-clock start, seconds in init_process_group (the start-up bench)
        self.dp_group, self.dp_size = self.groups.dp, self.groups.dp_size
        self.tie_groups = self.groups.ties  # Note [tie reduction] in schedules/passes.py: by group index
        self.tp_group = self.groups.tp  # the stage's collectives (Note [tensor parallelism])
        self._pairs = self.groups.pairs  # Note [point-to-point groups]: peer -> the group its messages travel on
        self._mesh = None
        self._pending: list = []
        self.blocked_ns = 0  # time spent waiting for point-to-point operations to complete (``_finish``)

    @property
    def tp_mesh(self):
        """The DeviceMesh over this actor's TP group (made once, when a plan first needs it)."""
        if self._mesh is None:
            if self.tp_group is None:
                raise RuntimeError("this actor has no TP group (tp=1): a tensor-parallel plan cannot apply")
            from .tensor_parallel import tp_mesh

            if self.backend == "gloo" and self.device.type == "cuda":  # actors sharing a GPU
                from .host_gather import gather_through_host

                gather_through_host("CUDA")  # Note [gloo all-gathers of CUDA tensors]
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
        group = self._pair(dst)
        return dist.isend(t, dst, group=group) if self._queues is None else self._queues.isend(t, dst, group)

    def _irecv(self, t: torch.Tensor, src: int):
        group = self._pair(src)
        return dist.irecv(t, src, group=group) if self._queues is None else self._queues.irecv(t, src, group)

    def _pair(self, peer: int):
        """The group this actor's messages with ``peer`` travel on (Note [point-to-point groups])."""
        if peer not in self._pairs and self.ordered:
            raise RuntimeError(f"actor {self.rank} has no point-to-point group with actor {peer}: the schedule "
                               f"links ranks the pipeline did not link when it started (Note [point-to-point groups])")
        return self._pairs.get(peer)

    def recv(self, metas: list[TensorMeta], src: int) -> list[torch.Tensor]:
        out = []
        for shape, dtype in metas:
            t = self._buffer(shape, dtype)
            self._finish(self._irecv(t, src), f"a receive from actor {src}")
            out.append(t)
        return self.from_wire(out)

    def _finish(self, work, what: str) -> None:
        """Wait for ``work``; in NCCL's order, for at most the deadline (Note [stuck operations]).
        The time it takes adds to ``blocked_ns`` (Note [where a step goes] in mpmd/profiler/split.py)."""
        t0 = time.perf_counter_ns()
        try:
            self._await(work, what)
        finally:
            self.blocked_ns += time.perf_counter_ns() - t0

    def _await(self, work, what: str) -> None:
        if not self.ordered:
            work.wait()  # gloo's own timeout raises
            return
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

    def abort(self) -> None:
        """Abort every NCCL communicator of this actor so no kernel stays stuck on the GPU (the
        queued transport's gloo operations end at the group's timeout instead)."""
        if self.aborted or self.backend != "nccl" or not dist.is_initialized():
            return
        self.aborted = True
        dist.distributed_c10d._abort_process_group()

    def irecv(self, metas: list[TensorMeta], src: int) -> tuple[list, list[torch.Tensor]]:
        """Post receives now (the transfer proceeds while this rank computes); ``wait_recv`` later."""
        tensors = [self._buffer(shape, dtype) for shape, dtype in metas]
        return [self._irecv(t, src) for t in tensors], tensors

    def wait_recv(self, handle: tuple[list, list[torch.Tensor]], src: int = -1) -> list[torch.Tensor]:
        works, tensors = handle
        for w in works:
            self._finish(w, f"a receive from actor {src}" if src >= 0 else "a receive")
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
        self._finish(self._irecv(t, src), f"a shape header from actor {src}")
        return t.cpu()

    def flush(self) -> None:
        """Wait for every outstanding send."""
        pending, self._pending = self._pending, []
        for work, _ in pending:
            self._finish(work, "a send of this step")

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
            self.start_mean(bucket).wait()
        return len(buckets)

    def start_mean(self, bucket: list[torch.Tensor]) -> "PendingMean":
        """Start averaging one bucket of tensors in place across the data-parallel replicas
        (``async_op``: on NCCL's stream, or gloo's thread); its ``wait`` ends it."""
        single = len(bucket) == 1 and bucket[0].is_contiguous() and not self.staged
        flat = bucket[0] if single else torch.cat([t.reshape(-1) for t in bucket])
        (wire,) = self.to_wire([flat]) if self.staged else (flat,)
        return PendingMean(dist.all_reduce(wire, group=self.dp_group, async_op=True), bucket, flat, wire,
                           self.dp_size, self._pin)

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
        if dist.is_initialized() and not self.aborted:  # an aborted group is gone already
            dist.destroy_process_group()
