"""Schedule generators and the name registry.

A generator takes ``(num_ranks, num_microbatches, stages_per_rank)`` and returns the
compute-only ``Schedule``; ``get_schedule`` checks the arguments and validates.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from .actions import Action, Kind
from .placement import looped_stage_to_rank
from .schedule import Schedule
from .validate import validate

__all__ = ["get_schedule", "register_schedule", "schedule_names", "schedule_info", "ScheduleInfo"]

Generator = Callable[[int, int, int], Schedule]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScheduleInfo:
    name: str
    build: Generator
    default_stages_per_rank: int = 1
    # None: any value >= 1 is accepted; otherwise the only values allowed.
    allowed_stages_per_rank: tuple[int, ...] | None = (1,)
    description: str = ""
    # The generator that writes the schedule's overlapped forward-backward pairs as OVERLAP
    # actions (Note [overlapped forward and backward] in actions.py); None: it has none.
    overlapped: Generator | None = None


_REGISTRY: dict[str, ScheduleInfo] = {}


def register_schedule(info: ScheduleInfo) -> ScheduleInfo:
    """Register a generator under ``info.name`` (replacing one of the same name)."""
    _REGISTRY[info.name] = info
    return info


def schedule_names() -> list[str]:
    return sorted(_REGISTRY)


def schedule_info(name: str) -> ScheduleInfo:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}; registered schedules: {', '.join(schedule_names())}") from None


def get_schedule(name: str, num_ranks: int, num_microbatches: int, stages_per_rank: int | None = None,
                 overlap: bool = False) -> Schedule:
    """Build a registered schedule and validate it; ``overlap``: with its forward-backward
    pairs as OVERLAP actions (``dualpipev``; ``ScheduleInfo.overlapped``).

    >>> get_schedule("1f1b", num_ranks=2, num_microbatches=2).to_text()
    '0F0 0F1 0B0 0B1\\n1F0 1B0 1F1 1B1'
    """
    info = schedule_info(name)
    v = info.default_stages_per_rank if stages_per_rank is None else stages_per_rank
    for label, val in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("stages_per_rank", v)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{label} must be a positive integer, got {val!r}")
    if info.allowed_stages_per_rank is not None and v not in info.allowed_stages_per_rank:
        allowed = " or ".join(map(str, info.allowed_stages_per_rank))
        hint = " (use interleaved-1f1b for several stages per rank)" if name in ("gpipe", "1f1b") else ""
        raise ValueError(f"{name} needs stages_per_rank = {allowed}, got {v}{hint}")
    if overlap and info.overlapped is None:
        have = ", ".join(n for n in schedule_names() if _REGISTRY[n].overlapped is not None) or "none"
        raise ValueError(f"{name} has no overlapped forward-backward pairs, so overlap=True does not apply; "
                         f"schedules that have them: {have} (or write OVERLAP actions like '1F3+0I2' in a "
                         f"schedule's text)")
    return validate((info.overlapped if overlap else info.build)(num_ranks, num_microbatches, v))


def _gpipe(p: int, m: int, v: int) -> Schedule:
    ranks = [[Action(r, Kind.F, i) for i in range(m)] + [Action(r, Kind.B, i) for i in range(m)] for r in range(p)]
    return Schedule(ranks, m, looped_stage_to_rank(p, 1), name="gpipe")


def _one_f_one_b(p: int, m: int, v: int) -> Schedule:
    ranks = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        acts = [Action(r, Kind.F, i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action(r, Kind.F, warmup + i), Action(r, Kind.B, i)]
        acts += [Action(r, Kind.B, i) for i in range(m - warmup, m)]
        ranks.append(acts)
    return Schedule(ranks, m, looped_stage_to_rank(p, 1), name="1f1b")


def _interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron-LM's interleaved 1F1B: chunk c of rank r is stage c*p + r."""
    if m % p:
        ok = ", ".join(str(p * k) for k in range(1, 4))
        raise ValueError(f"num_microbatches ({m}) must be divisible by num_ranks ({p}) for interleaved-1f1b; use {ok}")
    total = m * v

    def unit(k: int, forward: bool, r: int) -> Action:
        chunk = (k % (p * v)) // p
        if not forward:
            chunk = v - 1 - chunk
        mb = (k // (p * v)) * p + k % p
        return Action(chunk * p + r, Kind.F if forward else Kind.B, mb)

    ranks = []
    for r in range(p):
        warmup = total if m == p else min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [unit(k, True, r) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [unit(k + warmup, True, r), unit(k, False, r)]
        acts += [unit(k, False, r) for k in range(total - warmup, total)]
        ranks.append(acts)
    return Schedule(ranks, m, looped_stage_to_rank(p, v), name="interleaved-1f1b")


register_schedule(ScheduleInfo(name="gpipe", build=_gpipe, description="all forwards, then all backwards"))
register_schedule(ScheduleInfo(name="1f1b", build=_one_f_one_b, description="one forward, one backward (PipeDream-flush)"))
register_schedule(
    ScheduleInfo(
        name="interleaved-1f1b",
        build=_interleaved,
        default_stages_per_rank=2,
        allowed_stages_per_rank=None,
        description="Megatron-LM interleaved 1F1B, stage s on rank s % p",
    )
)
