"""When a pipeline overlaps one microbatch's forward with another's backward on an actor
(``Pipeline(overlap=...)``, ``LayoutConfig.overlap``; docs/overlap.md): the schedule's
``OVERLAP`` actions (Note [overlapped forward and backward] in schedules/actions.py), run on
the actors by actors/overlap.py (Note [overlap turns])."""

from __future__ import annotations

import dataclasses
from typing import Any

import schedules
from schedules import Kind, Schedule

__all__ = ["OVERLAP_MODES", "check_overlap", "overlap_wanted", "as_asked"]

OVERLAP_MODES = ("auto", True, False)


def check_overlap(value: Any, cp: int = 1) -> None:
    if not any(value is mode or (isinstance(value, str) and value == mode) for mode in OVERLAP_MODES):
        raise ValueError(f"overlap must be 'auto', True or False, got {value!r}")
    if cp > 1 and value is True:  # one shard context per actor (actors/cp_runtime.py), not per thread
        raise ValueError(f"overlap=True with cp={cp}: an overlapped forward and backward would share the actor's "
                         "one context-parallel shard context; use overlap=False or 'auto' (off under cp)")


def overlap_wanted(name: str, overlap: Any, ep: int, cp: int = 1) -> bool:
    """Whether the registered schedule ``name`` is built with its overlapped pairs: asked
    (``True``; a schedule without pairs is then refused by ``get_schedule``), or ``"auto"`` on
    a schedule that has pairs with the experts split over ``ep > 1`` replicas (the overlap
    hides their all-to-alls; without them it has nothing to hide) and no context parallelism
    (its shard context is the actor's, not a thread's: refused with ``True``)."""
    if overlap == "auto":
        return schedules.schedule_info(name).overlapped is not None and ep > 1 and cp == 1
    return overlap is True


def as_asked(schedule: Schedule, overlap: Any) -> Schedule:
    """A schedule given as such, as ``overlap`` asks: as written under ``"auto"``; refused
    under ``True`` when it has no ``OVERLAP`` action; under ``False`` each ``OVERLAP`` runs as
    its forward then its backward."""
    has = any(a.kind is Kind.OVERLAP for acts in schedule.ranks for a in acts)
    if overlap is True and not has:
        raise ValueError("overlap=True, but the schedule given has no OVERLAP action to run overlapped; write the "
                         "pairs as OVERLAP actions (e.g. '1F3+0I2' in its text), pass schedule='dualpipev', or "
                         "use overlap='auto'")
    if overlap is False and has:
        return schedules.validate(dataclasses.replace(schedule, ranks=[tuple(schedules.flat(acts))
                                                                        for acts in schedule.ranks]))
    return schedule
