"""The device grid: which actor is which (replica, pipeline rank, CP rank, tensor-parallel rank), and
the groups of actors that talk along each axis.  Pure Python, the same on the controller
and inside the actors.

Note [device grid]
Actors form a grid ``dp x pp x cp x tp``, replica-major, then pipeline rank, then context-parallel
(CP) rank, then tensor-parallel rank: actor ``(d, r, c, t)`` has index ``((d * pp + r) * cp + c) * tp
+ t`` in the controller's list and is that rank in the world process group.  The actors of one
pipeline rank form an SPMD mesh of shape ``(dp, cp, tp)``.  Groups: the world group carries
point-to-point traffic between pipeline ranks (CP rank ``c``, TP rank ``t`` talks to CP rank ``c``,
TP rank ``t`` of the next stage's mesh: the same shard of the same sequence); along ``dp x cp`` a
rank's actors average gradients (``zero=0``: all-reduce; ``zero=1``: reduce-scatter, each member
steps its shard, all-gather: Note [ZeRO-1 sharding] in actors/zero.py; Note [context-parallel
runtime] in actors/cp_runtime.py says why CP ranks join that average); along ``cp`` the ring of a
stage's attention (Note [ring attention] in actors/context.py); along ``tp`` a stage's own
collectives (Note [tensor parallelism] in actors/tensor_parallel.py).  Every place that needs an
actor's coordinates or a group asks a ``DeviceGrid`` instead of recomputing them.

Note [expert parallelism]
With ``ep > 1`` (``ep`` divides ``dp x cp``) each MoE block's experts are split over ``ep`` of a
pipeline rank's ``dp x cp`` actors (of one TP rank), as Megatron-Core draws the EP ranks from the
data- and context-parallel ones.  The members are numbered as the gradient average numbers them,
``m = replica x cp + CP rank`` (``reduce_index``): member ``m`` is EP rank ``m % ep`` of EP group
``m // ep`` (``ep`` consecutive members), and holds experts ``[(m % ep) * E/ep, (m % ep + 1) *
E/ep)`` of each block.  At ``cp = 1`` that is replica ``d``, EP rank ``d % ep``; at ``dp = 1, cp =
2, ep = 2`` the two CP ranks of the replica split the experts.  Tokens travel to their experts'
actors and back inside the forward (an all-to-all over the EP group, actors/experts.py): a router
sends rows whatever sequence or shard they come from, so CP ranks may share an EP group (their
tokens are shards of the same sequences) or not.  The dense parameters stay replicated over all
``dp x cp`` members and are averaged as before.  The members holding the same experts (the same
``m % ep``) form the rank's EDP ("expert data parallel") group of size ``dp x cp / ep``: an
expert's gradient already sums every EP-group member's tokens (the all-to-all's backward), so it
is all-reduced (SUM) over the EDP group and divided by ``dp x cp``, as the dense gradients are
(actors/dp_reduce.py).  Another layout (EP across pipeline ranks, or extra actors) would add
devices that hold no dense copy and break the grid's one-stage-per-mesh rule; drawing from
``dp x cp`` costs nothing but the all-to-all.  ``ep_member(e, rank)`` is the actor at member
``e``: members ``0..ep-1`` (EP group 0) hold every expert once, so they write the checkpoints'
expert pieces and answer ``pipe.state_dict()`` (Note [expert pieces] in actors/expert_state.py).
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

__all__ = ["DeviceGrid", "GridCoord"]


class GridCoord(NamedTuple):
    """An actor's place in the grid."""

    replica: int
    rank: int  # pipeline rank
    tp: int = 0

    def __str__(self) -> str:
        return f"replica {self.replica}, rank {self.rank}" + (f", tp {self.tp}" if self.tp else "")


@dataclasses.dataclass(frozen=True)
class DeviceGrid:
    """``dp`` replicas of a ``pp``-rank pipeline whose ranks span ``tp`` devices each (Note [device
    grid]); ``ep`` of a rank's replicas split its experts (Note [expert parallelism])."""

    dp: int
    pp: int
    tp: int = 1
    ep: int = 1
    cp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp", "ep", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DeviceGrid.{name} must be a positive integer, got {value!r}")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"DeviceGrid.ep={self.ep} must divide dp={self.dp} x cp={self.cp} "
                             f"(Note [expert parallelism])")

    @property
    def size(self) -> int:
        """Actors in the grid (the world group's size)."""
        return self.dp * self.pp * self.cp * self.tp

    def actor(self, replica: int, rank: int, tp: int = 0, cp: int = 0) -> int:
        """The index (and world rank) of the actor at ``(replica, rank, cp, tp)``."""
        if not (0 <= replica < self.dp and 0 <= rank < self.pp and 0 <= tp < self.tp and 0 <= cp < self.cp):
            raise IndexError(f"(replica {replica}, rank {rank}, cp {cp}, tp {tp}) is outside the grid dp={self.dp} x "
                             f"pp={self.pp} x cp={self.cp} x tp={self.tp}")
        return ((replica * self.pp + rank) * self.cp + cp) * self.tp + tp

    def coord(self, actor: int) -> GridCoord:
        """Where actor ``actor`` sits (its CP rank: ``cp_rank_of``)."""
        if not 0 <= actor < self.size:
            raise IndexError(f"actor {actor} is outside the grid of {self.size} actors")
        rest, tp = divmod(actor, self.tp)
        replica, rank = divmod(rest // self.cp, self.pp)
        return GridCoord(replica, rank, tp)

    def cp_rank_of(self, actor: int) -> int:
        """Actor ``actor``'s context-parallel rank: which zigzag shard of each sequence it holds."""
        self.coord(actor)  # in the grid
        return actor // self.tp % self.cp

    def rank_of(self, actor: int) -> int:
        return self.coord(actor).rank

    def replica_of(self, actor: int) -> int:
        return self.coord(actor).replica

    def pipeline(self, replica: int, tp: int = 0, cp: int = 0) -> list[int]:
        """The actors of one pipeline (one per rank), in rank order."""
        return [self.actor(replica, r, tp, cp) for r in range(self.pp)]

    @property
    def reducing(self) -> int:
        """How many actors of a pipeline rank average its gradients: ``dp x cp`` (Note [device grid])."""
        return self.dp * self.cp

    def reduce_index(self, replica: int, cp: int = 0) -> int:
        """An actor's place in its rank's gradient-averaging group (``dp_group``): ZeRO-1's owner index."""
        return replica * self.cp + cp

    def dp_group(self, rank: int, tp: int = 0) -> list[int]:
        """The replicas and CP ranks of pipeline rank ``rank`` (TP rank ``tp``): they average its gradients."""
        return [self.actor(d, rank, tp, c) for d in range(self.dp) for c in range(self.cp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, in the order every process creates them."""
        return [self.dp_group(r, t) for r in range(self.pp) for t in range(self.tp)]

    def tp_group(self, replica: int, rank: int, cp: int = 0) -> list[int]:
        """The devices one stage spans (tensor parallelism)."""
        return [self.actor(replica, rank, t, cp) for t in range(self.tp)]

    def cp_group(self, replica: int, rank: int, tp: int = 0) -> list[int]:
        """The actors one stage's sequence is sharded over (context parallelism), in CP-rank order."""
        return [self.actor(replica, rank, tp, c) for c in range(self.cp)]

    def cp_groups(self) -> list[list[int]]:
        """Every CP group, in the order every process creates them (Note [ring attention] in actors/context.py)."""
        return [self.cp_group(d, r, t) for d in range(self.dp) for r in range(self.pp) for t in range(self.tp)]

    def pair_groups(self, linked: list[tuple[int, int]]) -> list[list[int]]:
        """The two-actor point-to-point groups (Note [point-to-point groups] in actors/comm.py):
        each linked pair of pipeline ranks in every replica, CP rank and TP rank, in the order every
        process creates them."""
        return [[self.actor(d, a, t, c), self.actor(d, b, t, c)] for d in range(self.dp) for c in range(self.cp)
                for t in range(self.tp) for a, b in linked]

    def tp_groups(self) -> list[list[int]]:
        """Every TP group, in the order every process creates them (Note [tensor parallelism])."""
        return [self.tp_group(d, r, c) for d in range(self.dp) for r in range(self.pp) for c in range(self.cp)]

    # -- expert parallelism (Note [expert parallelism]) -------------------------------------------
    def ep_rank(self, replica: int, cp: int = 0) -> int:
        """The EP rank of the actor at ``(replica, cp)``: which slice of the experts it holds."""
        return self.reduce_index(replica, cp) % self.ep

    def ep_member(self, member: int, rank: int, tp: int = 0) -> int:
        """The actor that is member ``member`` (``replica x cp + CP rank``) of pipeline rank ``rank``."""
        replica, cp = divmod(member, self.cp)
        return self.actor(replica, rank, tp, cp)

    def ep_group(self, replica: int, rank: int, tp: int = 0, cp: int = 0) -> list[int]:
        """The actors of pipeline rank ``rank`` that split the experts with ``(replica, cp)``, in
        EP-rank order: ``ep`` consecutive members."""
        m = self.reduce_index(replica, cp)
        return [self.ep_member(e, rank, tp) for e in range(m - m % self.ep, m - m % self.ep + self.ep)]

    def edp_group(self, replica: int, rank: int, tp: int = 0, cp: int = 0) -> list[int]:
        """The actors of pipeline rank ``rank`` holding the same experts as ``(replica, cp)``: they
        sum those experts' gradients."""
        return [self.ep_member(e, rank, tp) for e in range(self.ep_rank(replica, cp), self.reducing, self.ep)]

    def ep_groups(self) -> list[list[int]]:
        """Every EP group, in the order every process creates them."""
        return [[self.ep_member(e, r, t) for e in range(g * self.ep, (g + 1) * self.ep)]
                for r in range(self.pp) for t in range(self.tp) for g in range(self.reducing // self.ep)]

    def edp_groups(self) -> list[list[int]]:
        """Every EDP group, in the order every process creates them."""
        return [[self.ep_member(m, r, t) for m in range(e, self.reducing, self.ep)]
                for r in range(self.pp) for t in range(self.tp) for e in range(self.ep)]
