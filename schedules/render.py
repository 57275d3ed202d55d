"""The time-aligned rank x time grid (the program-order grid, ``render_order``, is in ``text.py``)."""

from __future__ import annotations

from typing import Optional

from .actions import COMPUTE_KINDS
from .simulate import Costs, simulate
from .text import render_order
from .view import ScheduleView


__all__ = ["render"]


def render(schedule: ScheduleView, costs=None, mark: Optional[tuple[int, int]] = None) -> str:
    """Rank x time grid of the compute actions under ``costs`` (unit costs by default).

    Each column is one time unit; an action of cost c fills c columns (``B`` = b + w);
    ``.`` is idle.  Schedules that cannot be simulated, or non-integer costs, are shown
    in program order instead (``render_order``).
    """
    costs = costs or Costs()
    try:
        res = simulate(schedule, costs)
    except ValueError:
        return render_order(schedule, mark=mark)
    ticks = {a: (res.start[a], res.end[a]) for a in res.start}
    if any(t != int(t) for se in ticks.values() for t in se):
        return render_order(schedule, mark=mark)
    width = max(len(repr(a)) for a in ticks) if ticks else 1
    horizon = int(max((e for _, e in ticks.values()), default=0))
    rows = []
    for r, acts in enumerate(schedule.ranks):
        cells = ["." * width] * horizon
        for a in acts:
            if a.kind not in COMPUTE_KINDS:
                continue
            s, e = map(int, ticks[a])
            for t in range(s, e):
                cells[t] = repr(a).ljust(width)
        rows.append(f"rank {r}: " + " ".join(cells).rstrip())
    return "\n".join(rows)

