"""Validation of compute schedules: complete, on the owning rank, and able to finish."""

from __future__ import annotations

from typing import TypeVar

from collections import Counter

from .actions import Action, COMPUTE_KINDS, Kind
from .errors import ScheduleError
from .simulate import simulate
from .text import render_order
from .view import ScheduleView

S = TypeVar("S", bound=ScheduleView)


__all__ = ["validate"]


def _refuse(schedule: ScheduleView, rank: int, pos: int, why: str) -> ScheduleError:
    action = schedule.ranks[rank][pos]
    return ScheduleError(
        f"rank {rank}, position {pos}: {action!r} {why}\n" + render_order(schedule, mark=(rank, pos))
    )


def validate(schedule: S) -> S:
    """Check every (stage, microbatch) gets one ``F`` and one backward (``B``, or ``I`` and
    ``W``) on the owning rank, and that the order can finish.  Returns the schedule."""
    m, n = schedule.num_microbatches, schedule.num_stages
    seen: Counter = Counter()  # of single computes (an OVERLAP's parts)
    for r, acts in enumerate(schedule.ranks):
        for i, top in enumerate(acts):
            if top.kind is Kind.OVERLAP and schedule.forward_only:
                raise _refuse(schedule, r, i, "overlaps a backward in a forward-only schedule")
            for a in top.flat:  # an OVERLAP's parts each obey the rules of F and B/I
                _check_action(schedule, r, i, a, top, seen)
    for s in range(n):
        for mb in range(m):
            _check_complete(schedule, s, mb, seen)
    simulate(schedule)  # raises ScheduleError naming the stuck actions
    return schedule


def _check_action(schedule: ScheduleView, r: int, i: int, a: Action, top: Action, seen: Counter) -> None:
    """One action, or one part of the OVERLAP ``top`` (``_refuse`` names ``top``)."""
    m, n = schedule.num_microbatches, schedule.num_stages
    what = "" if a is top else f"part {a!r} "
    if not 0 <= a.stage < n:
        raise _refuse(schedule, r, i, f"{what}names stage {a.stage}, but stages are 0..{n - 1}")
    if a.microbatch is not None and not 0 <= a.microbatch < m:
        raise _refuse(schedule, r, i, f"{what}names microbatch {a.microbatch}, but microbatches are 0..{m - 1}")
    if a.kind in COMPUTE_KINDS:
        owner = schedule.stage_to_rank[a.stage]
        if owner != r:
            why = "" if a is top else " (both parts of an OVERLAP run on one rank, the one of their stages)"
            raise _refuse(schedule, r, i, f"{what}runs on rank {r}, but stage {a.stage} lives on rank {owner}{why}")
        if schedule.forward_only and a.kind is not Kind.F:
            raise _refuse(schedule, r, i, "is a backward action in a forward-only schedule")
        seen[a] += 1
        if seen[a] > 1:
            raise _refuse(schedule, r, i, f"{what}appears twice; each compute action runs exactly once")


def _check_complete(schedule: ScheduleView, s: int, mb: int, seen: Counter) -> None:
    has = {k for k in (Kind.F, Kind.B, Kind.I, Kind.W) if seen[Action(s, k, mb)]}
    where = f"rank {schedule.stage_to_rank[s]}"
    if Kind.F not in has:
        raise ScheduleError(f"{Action(s, Kind.F, mb)!r} is missing on {where}: every (stage, microbatch) needs one forward\n"
                            + render_order(schedule))
    if schedule.forward_only:
        return
    if Kind.B in has and (has & {Kind.I, Kind.W}):
        raise ScheduleError(f"stage {s}, microbatch {mb} has both B and I/W on {where}: use B, or I and W, not both")
    if Kind.B not in has and has != {Kind.F, Kind.I, Kind.W}:
        need = "W" if Kind.I in has else ("I" if Kind.W in has else "B (or I and W)")
        raise ScheduleError(
            f"stage {s}, microbatch {mb} has no {need} on {where}: every forward needs its backward\n"
            + render_order(schedule)
        )
