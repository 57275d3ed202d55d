"""The device grid: which actor is which (replica, pipeline rank, tensor-parallel rank), and
the groups of actors that talk along each axis.  Pure Python, the same on the controller
and inside the actors.

Note [device grid]
Actors form a grid ``dp x pp x tp``, replica-major, then pipeline rank, then tensor-parallel
rank: actor ``(d, r, t)`` has index ``(d * pp + r) * tp + t`` in the controller's list and is
that rank in the world process group.  The actors of one pipeline rank form an SPMD mesh of
shape ``(dp, tp)``.  Groups: the world group carries point-to-point traffic between pipeline
ranks (TP rank ``t`` talks to TP rank ``t`` of the next stage's mesh); along ``dp`` a rank's
replicas average gradients (``zero=0``: all-reduce; ``zero=1``: reduce-scatter, each replica
steps its shard, all-gather: Note [ZeRO-1 sharding] in actors/zero.py); along ``tp`` a stage's
own collectives (Note [tensor parallelism] in actors/tensor_parallel.py).  Every place that needs
an actor's coordinates or a group asks a ``DeviceGrid`` instead of recomputing them.
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
    """``dp`` replicas of a ``pp``-rank pipeline whose ranks span ``tp`` devices each (Note [device grid])."""

    dp: int
    pp: int
    tp: int = 1

    def __post_init__(self) -> None:
        for name in ("dp", "pp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DeviceGrid.{name} must be a positive integer, got {value!r}")

    @property
    def size(self) -> int:
        """Actors in the grid (the world group's size)."""
        return self.dp * self.pp * self.tp

    def actor(self, replica: int, rank: int, tp: int = 0) -> int:
        """The index (and world rank) of the actor at ``(replica, rank, tp)``."""
        if not (0 <= replica < self.dp and 0 <= rank < self.pp and 0 <= tp < self.tp):
            raise IndexError(f"({replica}, {rank}, {tp}) is outside the grid dp={self.dp} x pp={self.pp} x tp={self.tp}")
        return (replica * self.pp + rank) * self.tp + tp

    def coord(self, actor: int) -> GridCoord:
        """Where actor ``actor`` sits."""
        if not 0 <= actor < self.size:
            raise IndexError(f"actor {actor} is outside the grid of {self.size} actors")
        rest, tp = divmod(actor, self.tp)
        replica, rank = divmod(rest, self.pp)
        return GridCoord(replica, rank, tp)

    def rank_of(self, actor: int) -> int:
        return self.coord(actor).rank

    def replica_of(self, actor: int) -> int:
        return self.coord(actor).replica

    def pipeline(self, replica: int, tp: int = 0) -> list[int]:
        """The actors of one pipeline (one per rank), in rank order."""
        return [self.actor(replica, r, tp) for r in range(self.pp)]

    def dp_group(self, rank: int, tp: int = 0) -> list[int]:
        """The replicas of pipeline rank ``rank`` (TP rank ``tp``): they average its gradients."""
        return [self.actor(d, rank, tp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        """Every data-parallel group, in the order every process creates them."""
        return [self.dp_group(r, t) for r in range(self.pp) for t in range(self.tp)]

    def tp_group(self, replica: int, rank: int) -> list[int]:
        """The devices one stage spans (tensor parallelism)."""
        return [self.actor(replica, rank, t) for t in range(self.tp)]

    def pair_groups(self, linked: list[tuple[int, int]]) -> list[list[int]]:
        """The two-actor point-to-point groups (Note [point-to-point groups] in actors/comm.py):
        each linked pair of pipeline ranks in every replica and TP rank, in the order every
        process creates them."""
        return [[self.actor(d, a, t), self.actor(d, b, t)] for d in range(self.dp) for t in range(self.tp)
                for a, b in linked]

    def tp_groups(self) -> list[list[int]]:
        """Every TP group, in the order every process creates them (Note [tensor parallelism])."""
        return [self.tp_group(d, r) for d in range(self.dp) for r in range(self.pp)]
