"""Forming a pipeline's process groups with ``torch.distributed``, in the plan's order (Note
[group formation] in actors/group_plan.py): one class per way of forming them, chosen once
by the backend, and what one actor ends up holding."""

from __future__ import annotations

import datetime
import time
from typing import Optional

import torch.distributed as dist

from .group_plan import GroupKind, GroupPlan, GroupSpec

__all__ = ["FormedGroups", "Formation", "MembersOnly", "SplitRounds", "EveryRank", "FORMATIONS", "formation_for"]


class FormedGroups:
    """The groups one actor is in, by kind, and what forming them took."""

    def __init__(self) -> None:
        self.dp = None  # this pipeline rank's replicas (None: dp=1)
        self.dp_size = 1
        self.tp = None  # this stage's devices (None: tp=1)
        self.cp = None  # this stage's sequence shards (None: cp=1; Note [ring attention] in actors/context.py)
        self.ep = None  # the replicas splitting this rank's experts (None: ep=1; Note [expert parallelism])
        self.ep_size = 1
        self.edp = None  # the replicas holding the same experts (None: dp == ep)
        self.edp_size = 1
        self.ties: dict[int, object] = {}  # tie group index -> group
        self.pairs: dict[int, object] = {}  # peer -> the group its messages travel on
        self.pads: list = []  # one-actor groups (Note [group formation]): kept with the others
        self.calls = 0  # group-creation calls this actor made (new_group or split_group)
        self.seconds = 0.0

    def keep(self, spec: GroupSpec, rank: int, group) -> None:
        """File ``group``, formed for ``spec``, which this actor (``rank``) is in."""
        if spec.kind is GroupKind.DP:
            self.dp, self.dp_size = group, len(spec.ranks)
        elif spec.kind is GroupKind.TP:
            self.tp = group
        elif spec.kind is GroupKind.CP:
            self.cp = group
        elif spec.kind is GroupKind.EP:
            self.ep, self.ep_size = group, len(spec.ranks)
        elif spec.kind is GroupKind.EDP:
            self.edp, self.edp_size = group, len(spec.ranks)
        elif spec.kind is GroupKind.TIE:
            self.ties[spec.index] = group
        elif spec.kind is GroupKind.PAIR:
            for peer in spec.ranks:
                if peer != rank:
                    self.pairs.setdefault(peer, group)
        else:
            self.pads.append(group)


class Formation:
    """One way of forming a plan's groups on one actor."""

    name = ""

    def form(self, plan: GroupPlan, rank: int, *, backend: str,
             timeouts: dict[GroupKind, datetime.timedelta]) -> FormedGroups:
        formed = FormedGroups()
        t0 = time.perf_counter()
        self._form(plan, rank, backend, timeouts, formed)
        formed.seconds = time.perf_counter() - t0
        return formed

    def _form(self, plan: GroupPlan, rank: int, backend: str, timeouts: dict, formed: FormedGroups) -> None:
        raise NotImplementedError


class MembersOnly(Formation):
    """Gloo: each actor forms only its own groups (and pads), locally synchronised, in the
    order in which their members' names agree (``GroupPlan.members_order``)."""

    name = "members"

    def _form(self, plan, rank, backend, timeouts, formed) -> None:
        for spec in plan.member_calls(rank):
            group = dist.new_group(list(spec.ranks), backend=backend, timeout=timeouts.get(spec.kind),
                                   use_local_synchronization=True)
            formed.calls += 1
            formed.keep(spec, rank, group)


class SplitRounds(Formation):
    """NCCL with an eagerly made world group: one ``split_group`` (one ``ncclCommSplit`` of
    the world communicator) per round of disjoint groups, entered by every rank, members or
    not (``GroupPlan.split_rounds``)."""

    name = "split"

    def _form(self, plan, rank, backend, timeouts, formed) -> None:
        for specs in plan.split_rounds:
            group = dist.split_group(split_ranks=[list(s.ranks) for s in specs], timeout=timeouts.get(specs[0].kind))
            formed.calls += 1
            mine = next((s for s in specs if rank in s.ranks), None)
            if mine is not None:
                formed.keep(mine, rank, group)


class EveryRank(Formation):
    """Every actor enters ``new_group`` for every group, in the canonical order: torch's
    default, and this runtime's way before Note [group formation] (kept as the start-up
    bench's baseline: ``python -m mpmd bench startup``)."""

    name = "every"

    def _form(self, plan, rank, backend, timeouts, formed) -> None:
        for spec in plan.groups:
            group = dist.new_group(list(spec.ranks), backend=backend, timeout=timeouts.get(spec.kind))
            formed.calls += 1
            if rank in spec.ranks:
                formed.keep(spec, rank, group)


FORMATIONS = {f.name: f for f in (MembersOnly, SplitRounds, EveryRank)}


def formation_for(backend: str, requested: Optional[str] = None) -> Formation:
    """``requested`` (a name of ``FORMATIONS``), or the backend's own: NCCL splits the world's
    communicator by rounds, gloo lets each actor form its own groups."""
    name = requested or ("split" if backend == "nccl" else "members")
    if name not in FORMATIONS:
        raise ValueError(f"unknown group formation {name!r}; use one of {', '.join(FORMATIONS)}")
    if name == "split" and backend != "nccl":
        raise ValueError("group formation 'split' needs NCCL (torch splits only an eagerly made NCCL world group); "
                         "use 'members' or 'every' with gloo")
    return FORMATIONS[name]()
