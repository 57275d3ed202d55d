"""The ``Schedule`` value: per-rank ordered actions plus the stage -> rank map."""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Mapping, Optional, Sequence, Union

from .actions import Action, Kind

__all__ = ["Schedule", "ScheduleError", "looped_stage_to_rank", "v_stage_to_rank"]


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot finish (it would hang at run time)."""


def looped_stage_to_rank(num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage s on rank s % p (GPipe, 1F1B, interleaved 1F1B)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V shape: stage s and 2p-1-s on the same rank (ZB-V, DualPipeV)."""
    down = list(range(num_ranks))
    return tuple(down + down[::-1])


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Per-rank ordered action lists of one training (or forward-only) step.

    ``ranks[r]`` is the program order of rank ``r``; ``stage_to_rank[s]`` is the
    rank that owns stage ``s``.  A schedule may be compute-only (``F``/``B``/``I``/``W``)
    or lowered (with send/recv, all-reduce and free actions added by passes).
    """

    ranks: tuple[tuple[Action, ...], ...]
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    name: str = "custom"
    forward_only: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(tuple(r) for r in self.ranks))
        object.__setattr__(self, "stage_to_rank", tuple(self.stage_to_rank))
        if not self.ranks:
            raise ScheduleError("a schedule needs at least one rank")
        if self.num_microbatches < 1:
            raise ScheduleError(f"num_microbatches must be >= 1, got {self.num_microbatches}")
        bad = [s for s, r in enumerate(self.stage_to_rank) if not 0 <= r < self.num_ranks]
        if bad:
            raise ScheduleError(
                f"stage_to_rank maps stage {bad[0]} to rank {self.stage_to_rank[bad[0]]}, "
                f"but ranks are 0..{self.num_ranks - 1}"
            )
        if not self.stage_to_rank:
            raise ScheduleError("stage_to_rank is empty: a schedule needs at least one stage")

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @functools.cached_property
    def backward_kind(self) -> dict[int, Kind]:
        """Per stage, ``Kind.B`` (fused backward) or ``Kind.I`` (split into I + W)."""
        kinds = {s: Kind.B for s in range(self.num_stages)}
        for acts in self.ranks:
            for a in acts:
                if a.kind is Kind.I:
                    kinds[a.stage] = Kind.I
        return kinds

    def stages_of(self, rank: int) -> tuple[int, ...]:
        return tuple(s for s, r in enumerate(self.stage_to_rank) if r == rank)

    def replace(self, **changes) -> "Schedule":
        return dataclasses.replace(self, **changes)

    # -- construction from user input ---------------------------------------------------------
    @classmethod
    def from_lists(
        cls,
        ranks: Sequence[Iterable[Union[Action, str]]],
        num_microbatches: Optional[int] = None,
        stage_to_rank: Optional[Sequence[int]] = None,
        name: str = "custom",
    ) -> "Schedule":
        """Build and validate a user-defined schedule from per-rank lists of actions or text.

        ``num_microbatches`` and ``stage_to_rank`` default to what the actions show
        (each stage on the rank whose list holds its forwards).
        """
        from .validate import validate

        parsed = [[a if isinstance(a, Action) else Action.parse(a) for a in r] for r in ranks]
        if stage_to_rank is None:
            stage_to_rank = _infer_stage_to_rank(parsed)
        if num_microbatches is None:
            mbs = [a.microbatch for r in parsed for a in r if a.microbatch is not None]
            num_microbatches = max(mbs) + 1 if mbs else 0
        sched = cls(tuple(map(tuple, parsed)), num_microbatches, tuple(stage_to_rank), name)
        validate(sched)
        return sched

    @classmethod
    def from_text(
        cls,
        text: Union[str, Sequence[str], Mapping[int, str]],
        num_microbatches: Optional[int] = None,
        stage_to_rank: Optional[Sequence[int]] = None,
        name: str = "custom",
    ) -> "Schedule":
        """Parse ``"0F0 0F1 0B0 0B1"`` per rank: a list of lines, or one string with a line per rank."""
        if isinstance(text, str):
            lines = [ln for ln in text.strip().splitlines() if ln.strip()]
        elif isinstance(text, Mapping):
            lines = [text[r] for r in sorted(text)]
        else:
            lines = list(text)
        if not lines:
            raise ScheduleError("schedule text is empty: give one line of actions per rank, e.g. '0F0 0B0'")
        ranks = [_strip_rank_label(ln).split() for ln in lines]
        return cls.from_lists(ranks, num_microbatches, stage_to_rank, name)

    def to_text(self) -> str:
        return "\n".join(" ".join(map(repr, r)) for r in self.ranks)

    def render(self, costs=None, mark: Optional[tuple[int, int]] = None) -> str:
        """A rank x time grid.  See ``schedules.render``."""
        from .render import render

        return render(self, costs=costs, mark=mark)

    def __str__(self) -> str:
        return self.render()


def _strip_rank_label(line: str) -> str:
    # Accept "rank 0: 0F0 0B0" and "0: 0F0 0B0" as well as bare action lists.
    head, sep, rest = line.partition(":")
    return rest if sep else line


def _infer_stage_to_rank(ranks: list[list[Action]]) -> list[int]:
    owner: dict[int, int] = {}
    for r, acts in enumerate(ranks):
        for a in acts:
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
