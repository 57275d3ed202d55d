"""Which compute actions each compute action consumes (DESIGN.md, "Simulator semantics")."""

from __future__ import annotations

from typing import Sequence

from .actions import Action, BACKWARD_KINDS, Kind
from .view import ScheduleView


__all__ = ["dependencies", "boundary_of", "tie_groups"]


def dependencies(schedule: ScheduleView, action: Action) -> list[Action]:
    """The compute actions whose outputs ``action`` consumes (DESIGN.md semantics); an
    OVERLAP's are its parts' (Note [overlapped forward and backward] in actions.py)."""
    if action.parts is not None:
        return [d for part in action.parts for d in dependencies(schedule, part)]
    s, k, m = action.stage, action.kind, action.microbatch
    last = schedule.num_stages - 1
    if k is Kind.F:
        return [Action(s - 1, Kind.F, m)] if s > 0 else []
    if k in BACKWARD_KINDS:
        if s == last:
            return [Action(s, Kind.F, m)]
        return [Action(s + 1, schedule.backward_of(s + 1, m), m), Action(s, Kind.F, m)]
    if k is Kind.W:
        return [Action(s, Kind.I, m)]
    return []


def boundary_of(producer: Action, consumer: Action) -> int:
    """The stage boundary a value crosses from ``producer`` to ``consumer``: boundary ``s``
    lies between stages ``s`` and ``s + 1`` (an activation forward, its gradient back)."""
    return min(producer.stage, consumer.stage)


def tie_groups(orders: Sequence[Sequence[Action]]) -> dict[int, dict[int, Action]]:
    """Per tie group, each rank's ``TIE_REDUCE`` of it (a collective: it runs once every
    member is there), from the ranks' action orders."""
    ties: dict[int, dict[int, Action]] = {}
    for r, acts in enumerate(orders):
        for a in acts:
            if a.kind is Kind.TIE_REDUCE:
                ties.setdefault(a.tie_group, {})[r] = a
    return ties
