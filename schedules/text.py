"""The text form of a schedule: parsing per-rank action lines, and the program-order grid.

``Schedule.from_text`` and ``Schedule.from_lists`` parse with these; error messages
and ``render_order`` (which marks the failing cell) print with it.  Nothing here needs
the ``Schedule`` class: ``render_order`` reads ``.ranks`` of what it is given.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Optional, Sequence, Union

from .actions import Action, Kind, flat
from .errors import ScheduleError
from .view import ScheduleView


__all__ = ["render_order", "split_rank_lines", "parse_actions", "infer_stage_to_rank"]


def render_order(schedule: ScheduleView, mark: Optional[tuple[int, int]] = None) -> str:
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


def split_rank_lines(text: Union[str, Sequence[str], Mapping[int, str]]) -> list[list[str]]:
    """The action words of each rank: one string with a line per rank, a list of lines,
    or a ``{rank: line}`` mapping; a ``"rank 0:"`` or ``"0:"`` label is dropped."""
    if isinstance(text, str):
        lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    elif isinstance(text, Mapping):
        lines = [text[r] for r in sorted(text)]
    else:
        lines = list(text)
    if not lines:
        raise ScheduleError("schedule text is empty: give one line of actions per rank, e.g. '0F0 0B0'")
    return [_strip_rank_label(ln).split() for ln in lines]


def parse_actions(ranks: Sequence[Iterable[Union[Action, str]]]) -> list[list[Action]]:
    """Per-rank lists of actions, parsing the ones given as text (``"1F0"``)."""
    return [[a if isinstance(a, Action) else Action.parse(a) for a in r] for r in ranks]


def _strip_rank_label(line: str) -> str:
    # Accept "rank 0: 0F0 0B0" and "0: 0F0 0B0" as well as bare action lists.
    head, sep, rest = line.partition(":")
    return rest if sep else line


def infer_stage_to_rank(ranks: Sequence[Sequence[Action]]) -> list[int]:
    """Each stage on the rank whose list holds its forwards."""
    owner: dict[int, int] = {}
    for r, acts in enumerate(ranks):
        for a in flat(acts):
            if a.kind is Kind.F:
                prev = owner.setdefault(a.stage, r)
                if prev != r:
                    raise ScheduleError(
                        f"stage {a.stage} has forwards on rank {prev} and rank {r}; "
                        "a stage lives on one rank (pass stage_to_rank to say which)"
                    )
    if not owner:
        raise ScheduleError("the schedule has no forward (F) actions, so its stages are unknown")
    n = max(owner) + 1
    missing = [s for s in range(n) if s not in owner]
    if missing:
        raise ScheduleError(f"stage {missing[0]} has no forward action on any rank (stages are 0..{n - 1})")
    return [owner[s] for s in range(n)]
