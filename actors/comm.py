"""An actor's process groups, its collectives, and its point-to-point transport.

Built on ``torch.distributed`` process groups (gloo on CPU, NCCL on GPU), formed
once per pipeline: one world group for activations and gradients, and one group
per pipeline rank across its data-parallel replicas.  Every operation carries the
group's timeout, so a dead or hung peer becomes an error, never a hang.  How messages
move (gloo, staged, NCCL, NCCL's order on gloo) is one ``Transport`` class
(actors/transports.py), chosen once when the ``Communicator`` is built; where tensors
travel is its ``Staging`` (actors/staging.py), which the collectives here use too.
Note [staged transport] lives in actors/staging.py and Note [stuck operations] in
actors/transports.py, beside the code they describe.

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
unordered transport sends on the world group (``Transport.pair_groups``).
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
from .transports import FIRST_STEP_S, WATCHDOG_MARGIN_S, CommTimeout, select_transport
from .values import TensorMeta

__all__ = ["Communicator", "CommTimeout", "free_address", "node_ip", "FIRST_STEP_S", "WATCHDOG_MARGIN_S"]


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
    """This actor's groups (world, data-parallel, tensor-parallel, ties, point-to-point pairs),
    the collectives on them, and the point-to-point ``transport`` its messages go through.
    ``backend``, ``staged`` and ``queued`` are the controller's choice (mpmd/runtime/transport.py)."""

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
        ep_groups: Sequence[Sequence[int]] = (),
        edp_groups: Sequence[Sequence[int]] = (),
        cp_groups: Sequence[Sequence[int]] = (),
    ) -> None:
        kind, self.staging = select_transport(backend, staged=staged, queued=queued, device=device)  # chosen once
        self.rank, self.device, self.backend = rank, device, kind.backend
        self.wire = self.staging.wire  # Note [staged transport] in actors/staging.py
        began, t0 = time.time(), time.perf_counter()
        dist.init_process_group(
            kind.backend,
            init_method=f"tcp://{address[0]}:{address[1]}",
            world_size=world_size,
            rank=rank,
            timeout=datetime.timedelta(seconds=kind.world_timeout_s(timeout_s)),  # Note [stuck operations]
            device_id=kind.bound_device(device),
        )
        world_s = time.perf_counter() - t0
        # Note [group formation] in actors/group_plan.py: each actor forms only the groups it is in
        # (gloo), or every actor splits the world's communicator once per round (NCCL).
        pair_timeout = datetime.timedelta(seconds=timeout_s + FIRST_STEP_S + WATCHDOG_MARGIN_S)  # watched first
        plan = GroupPlan.of(dp=dp_groups, tp=tp_groups, ties=tie_groups, ep=ep_groups, edp=edp_groups, cp=cp_groups,
                            pairs=kind.pair_groups(p2p_groups))  # Note [point-to-point groups]
        self.groups = formation_for(kind.backend, formation).form(plan, rank, backend=kind.backend,
                                                                  timeouts={GroupKind.PAIR: pair_timeout})
        self.started = (began, world_s)  # wall-clock start, seconds in init_process_group (the start-up bench)
        self.dp_group, self.dp_size = self.groups.dp, self.groups.dp_size
        self.tie_groups = self.groups.ties  # Note [tie reduction] in schedules/passes.py: by group index
        self.tp_group = self.groups.tp  # the stage's collectives (Note [tensor parallelism])
        self.cp_group = self.groups.cp  # the stage's ring attention (Note [ring attention] in actors/context.py)
        # Note [expert parallelism] in actors/grid.py: the all-to-alls' group, and the experts' gradient sum's
        self.ep_group, self.ep_size = self.groups.ep, self.groups.ep_size
        self.edp_group, self.edp_size = self.groups.edp, self.groups.edp_size
        self.transport = kind(self.staging, rank=rank, timeout_s=timeout_s, pairs=self.groups.pairs)
        self._mesh = None

    @property
    def tp_mesh(self):
        """The DeviceMesh over this actor's TP group (made once, when a plan first needs it)."""
        if self._mesh is None:
            if self.tp_group is None:
                raise RuntimeError("this actor has no TP group (tp=1): a tensor-parallel plan cannot apply")
            from .tensor_parallel import tp_mesh

            self.staging.before_dtensor()  # actors sharing a GPU: Note [gloo all-gathers of CUDA tensors]
            self._mesh = tp_mesh(self.tp_group, self.device)
        return self._mesh

    # -- the transport's state, as the worker reads and sets it ---------------------------------
    @property
    def ordered(self) -> bool:
        """Each pair's operations run in posted order (Note [NCCL order] in schedules/posting.py)."""
        return self.transport.ordered

    @property
    def blocked_ns(self) -> int:
        """Time spent waiting for point-to-point operations to complete."""
        return self.transport.blocked_ns

    @property
    def first_step(self) -> bool:
        """A program's first step: more patience while pairs connect (Note [stuck operations])."""
        return self.transport.first_step

    @first_step.setter
    def first_step(self, value: bool) -> None:
        self.transport.first_step = value

    @property
    def aborted(self) -> bool:
        return self.transport.aborted

    # -- staging (Note [staged transport] in actors/staging.py) --------------------------------
    def to_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """``tensors`` as they travel: themselves, or staged copies in (pinned) host memory."""
        return self.staging.to_wire(tensors)

    def from_wire(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return self.staging.from_wire(tensors)

    # -- point to point (the transport's) ------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Asynchronous send; completion is awaited by ``flush`` (see Note [deadlock-free ordering])."""
        self.transport.send(tensors, dst)

    def recv(self, metas: list[TensorMeta], src: int) -> list[torch.Tensor]:
        return self.transport.recv(metas, src)

    def irecv(self, metas: list[TensorMeta], src: int) -> tuple[list, list[torch.Tensor]]:
        """Post receives now (the transfer proceeds while this rank computes); ``wait_recv`` later."""
        return self.transport.irecv(metas, src)

    def wait_recv(self, handle: tuple[list, list[torch.Tensor]], src: int = -1) -> list[torch.Tensor]:
        return self.transport.wait_recv(handle, src)

    def arrived(self, handle: tuple[list, list[torch.Tensor]]) -> bool:
        """Whether a posted receive has completed, asked without waiting (False: cannot tell)."""
        return self.transport.arrived(handle)

    def send_header(self, header: torch.Tensor, dst: int) -> None:
        self.transport.send_header(header, dst)

    def recv_header(self, src: int) -> torch.Tensor:
        return self.transport.recv_header(src)

    def flush(self) -> None:
        """Wait for every outstanding send."""
        self.transport.flush()

    def abort(self) -> None:
        """Abort every NCCL communicator of this actor (Note [stuck operations])."""
        self.transport.abort()

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

    def start_mean(self, bucket: list[torch.Tensor]) -> PendingMean:
        """Start averaging one bucket of tensors in place across the data-parallel replicas
        (``async_op``: on NCCL's stream, or gloo's thread); its ``wait`` ends it."""
        return self.staging.start_mean(bucket, self.dp_group, self.dp_size)

    def allreduce_sum(self, tensors: list[torch.Tensor], group_index: int, bucket_bytes: int) -> None:
        """Sum ``tensors`` in place over tie group ``group_index`` (every member passes the
        same tensors in the same order)."""
        self._sum(tensors, self.tie_groups[group_index], bucket_bytes)

    def expert_sum(self, tensors: list[torch.Tensor], bucket_bytes: int) -> None:
        """Sum ``tensors`` (expert gradients) in place over the EDP group, the replicas holding the
        same experts (Note [expert parallelism] in actors/grid.py); nothing when it is this actor alone."""
        if self.edp_group is not None:
            self._sum(tensors, self.edp_group, bucket_bytes)

    def dp_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` summed over this rank's data-parallel replicas (a new tensor where ``tensor`` is;
        it travels from this actor's device, as NCCL needs)."""
        out = tensor.detach().to(self.device, copy=True)
        if self.dp_group is not None:
            self._sum([out], self.dp_group, 0)
        return out.to(tensor.device)

    def _sum(self, tensors: list[torch.Tensor], group, bucket_bytes: int) -> None:
        for bucket in bucket_tensors(tensors, bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            self.staging.all_reduce(flat, group)  # through host memory when staged
            offset = 0
            for t in bucket:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()

    def all_true(self, flag: bool) -> bool:
        """Whether ``flag`` holds on every actor of the pipeline (a MIN all-reduce over the world)."""
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=self.wire)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def close(self) -> None:
        self.transport.close()
        if dist.is_initialized() and not self.transport.aborted:  # an aborted group is gone already
            dist.destroy_process_group()
