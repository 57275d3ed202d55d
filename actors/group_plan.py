"""A pipeline's process groups as data: which groups there are, the order they are formed in,
and which calls each actor makes to form them.  Pure Python, the same on every actor;
``actors/groups.py`` forms them with ``torch.distributed``.

Note [group formation]
Besides the world group, a pipeline has a data-parallel group per (pipeline rank, TP rank), a
TP group per (replica, pipeline rank), a tie group per (tie, replica, TP rank) and, in NCCL's
order, a two-actor group per linked pair per (replica, TP rank) (Note [point-to-point groups]
in actors/comm.py): about ``2N`` groups for ``N`` actors, each actor in a handful of them.
``torch.distributed.new_group`` as usually called must be entered by every process for every
group, members or not: ``N`` calls per actor, ``N**2`` in all.  What a call costs a non-member
depends on the backend:

* gloo: nothing but bookkeeping (the group's name is a counter every process steps); members
  rendezvous through the world's TCP store.  ``use_local_synchronization=True`` lets only the
  members call, but then the group's name is ``sha1(ranks, len(_world.pg_names))``
  (``_hash_ranks_to_str`` in torch's distributed_c10d.py): the number of groups *this process*
  has formed so far, and the members meet under that name in the store.  So every member must
  have formed as many groups as every other when it forms this one, or they wait for each other
  under different names until the timeout.  ``members_order`` orders the groups so that they
  have: it forms, pass by pass in the canonical order, each group whose members agree; where no
  remaining group's members agree (a pipeline whose pairs form an odd cycle, as 1F1B's ring on
  an odd number of ranks does, or a chain of three), a member that is behind first forms a
  group of its own alone (a ``PAD`` group: a one-actor gloo group, a store key and two idle
  threads).  Each actor then calls ``new_group`` only for its own groups and pads: a handful,
  whatever ``N``.  Each forms them in this one order, so none waits on a group whose members
  are still forming an earlier one (the earliest unformed group always has all its members).
* NCCL, whose world group is made eagerly (``device_id``, which Note [point-to-point groups]
  relies on): every ``new_group`` is a ``ncclCommSplit`` of the world communicator, collective
  over all ``N`` ranks (non-members split with ``NCCL_SPLIT_NOCOLOR``), so local
  synchronisation would leave the members waiting for ranks that never come (torch PR 129965).
  ``split_rounds`` instead packs the groups of each kind into rounds of disjoint groups, and
  each round is one ``torch.distributed.split_group`` (one ``ncclCommSplit``) entered by every
  rank, as ``DeviceMesh`` creates its dimensions: about five rounds whatever ``N`` instead of
  ``2N`` world-wide splits, each communicator still made eagerly, one per group.

The canonical order is: data-parallel groups, TP groups, EP groups, EDP groups (each actor in
exactly one of each, so they keep every actor's count equal), point-to-point pairs, ties.  ``GroupSpec.index`` is a
group's position in the list the controller gave for its kind (a tie group's is the index that
``TIE_REDUCE`` names, Note [tie reduction] in schedules/passes.py).
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
from typing import NamedTuple, Sequence

__all__ = ["GroupKind", "GroupSpec", "GroupPlan"]


class GroupKind(str, enum.Enum):
    DP = "dp"  # a pipeline rank's replicas (gradient averages)
    TP = "tp"  # one stage's devices (Note [tensor parallelism])
    CP = "cp"  # one stage's sequence shards: the ring attention's group (Note [ring attention] in actors/context.py)
    EP = "ep"  # the replicas splitting a rank's experts: the all-to-alls (Note [expert parallelism] in actors/grid.py)
    EDP = "edp"  # the replicas holding the same experts: their gradients' sum
    PAIR = "pair"  # two linked actors' point-to-point messages (Note [point-to-point groups])
    TIE = "tie"  # the actors holding one tie's stages (Note [tie reduction])
    PAD = "pad"  # one actor alone, keeping gloo's group names in step (Note [group formation])


class GroupSpec(NamedTuple):
    """One group to form: its kind, its index among the given groups of that kind, its world ranks."""

    kind: GroupKind
    index: int
    ranks: tuple[int, ...]  # ascending

    def __repr__(self) -> str:
        return f"{self.kind.value}{self.index}{list(self.ranks)}"


def _specs(kind: GroupKind, groups: Sequence[Sequence[int]]) -> list[GroupSpec]:
    """The groups of ``kind`` worth forming: one actor alone needs no group (dp or tp of 1)."""
    return [GroupSpec(kind, i, tuple(sorted(g))) for i, g in enumerate(groups) if len(g) > 1]


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """Every group of a pipeline, in the canonical order (Note [group formation])."""

    groups: tuple[GroupSpec, ...]

    @classmethod
    def of(cls, *, dp: Sequence[Sequence[int]] = (), tp: Sequence[Sequence[int]] = (),
           pairs: Sequence[Sequence[int]] = (), ties: Sequence[Sequence[int]] = (),
           ep: Sequence[Sequence[int]] = (), edp: Sequence[Sequence[int]] = (),
           cp: Sequence[Sequence[int]] = ()) -> "GroupPlan":
        """The plan of these groups (world ranks, each list as ``DeviceGrid`` and ``tie_groups_of``
        give it); groups of one actor are left out."""
        return cls(tuple(_specs(GroupKind.DP, dp) + _specs(GroupKind.TP, tp) + _specs(GroupKind.CP, cp)
                         + _specs(GroupKind.EP, ep)
                         + _specs(GroupKind.EDP, edp) + _specs(GroupKind.PAIR, pairs) + _specs(GroupKind.TIE, ties)))

    @functools.cached_property
    def members_order(self) -> tuple[GroupSpec, ...]:
        """The groups, with ``PAD`` groups where needed, in an order in which each group's members
        have formed equally many groups before it (Note [group formation]): gloo's order."""
        formed: collections.Counter = collections.Counter()  # world rank -> groups it has formed
        order: list[GroupSpec] = []
        pending, pads = list(self.groups), 0

        def form(g: GroupSpec) -> None:
            order.append(g)
            formed.update(g.ranks)

        while pending:
            rest = []
            for g in pending:
                if len({formed[r] for r in g.ranks}) == 1:
                    form(g)
                else:
                    rest.append(g)
            if len(rest) == len(pending):  # stuck: the members behind catch up alone first
                for g in rest:
                    top = max(formed[r] for r in g.ranks)
                    for r in g.ranks:
                        for _ in range(top - formed[r]):
                            form(GroupSpec(GroupKind.PAD, pads, (r,)))
                            pads += 1
                    form(g)
                rest = []
            pending = rest
        return tuple(order)

    @functools.cached_property
    def _by_rank(self) -> dict[int, tuple[GroupSpec, ...]]:
        mine: dict[int, list[GroupSpec]] = collections.defaultdict(list)
        for g in self.members_order:
            for r in g.ranks:
                mine[r].append(g)
        return {r: tuple(gs) for r, gs in mine.items()}

    def member_calls(self, rank: int) -> tuple[GroupSpec, ...]:
        """The groups actor ``rank`` forms itself under gloo, in order: its own and its pads."""
        return self._by_rank.get(rank, ())

    @functools.cached_property
    def split_rounds(self) -> tuple[tuple[GroupSpec, ...], ...]:
        """The groups without pads, packed per kind into rounds of disjoint groups (first fit, in
        the canonical order): one ``split_group`` each, entered by every rank (NCCL's way)."""
        rounds: list[tuple[GroupSpec, ...]] = []
        kinds = list(dict.fromkeys(g.kind for g in self.groups))
        for kind in kinds:
            packed: list[list[GroupSpec]] = []
            used: dict[int, set[int]] = collections.defaultdict(set)  # rank -> rounds it is in
            for g in (g for g in self.groups if g.kind == kind):
                taken = set().union(*(used[r] for r in g.ranks))
                k = next(i for i in range(len(packed) + 1) if i not in taken)
                if k == len(packed):
                    packed.append([])
                packed[k].append(g)
                for r in g.ranks:
                    used[r].add(k)
            rounds += [tuple(p) for p in packed]
        return tuple(rounds)

    def calls(self, rank: int, formation: str) -> int:
        """``torch.distributed`` group-creation calls of actor ``rank`` (the world's not counted):
        ``"every"`` (every actor enters every ``new_group``), ``"members"`` (gloo, Note [group
        formation]) or ``"split"`` (NCCL)."""
        if formation == "every":
            return len(self.groups)
        if formation == "members":
            return len(self.member_calls(rank))
        if formation == "split":
            return len(self.split_rounds)
        raise ValueError(f"unknown group formation {formation!r}; use 'every', 'members' or 'split'")
