"""Text rendering: a time-aligned rank x time grid, and a program-order grid."""

from __future__ import annotations

from typing import Optional

from .actions import COMPUTE_KINDS
from .schedule import Schedule

__all__ = ["render", "render_order"]


def render(schedule: Schedule, costs=None, mark: Optional[tuple[int, int]] = None) -> str:
    """Rank x time grid of the compute actions under ``costs`` (unit costs by default).

    Each column is one time unit; an action of cost c fills c columns (``B`` = b + w);
    ``.`` is idle.  Schedules that cannot be simulated, or non-integer costs, are shown
    in program order instead (``render_order``).
    """
    from .simulate import Costs, simulate

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


def render_order(schedule: Schedule, mark: Optional[tuple[int, int]] = None) -> str:
    """Each rank's actions in program order; ``mark=(rank, position)`` brackets one cell."""
    width = max((len(repr(a)) for acts in schedule.ranks for a in acts), default=1) + 2
    rows = []
    for r, acts in enumerate(schedule.ranks):
        cells = []
        for i, a in enumerate(acts):
            text = f"[{a!r}]" if mark == (r, i) else f" {a!r} "
            cells.append(text.ljust(width))
        rows.append(f"rank {r}: " + "".join(cells).rstrip())
    return "\n".join(rows)
