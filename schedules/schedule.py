"""The ``Schedule`` value: per-rank ordered actions plus the stage -> rank map.

It sits above the modules it uses (``text`` to parse, ``validate`` to check,
``render`` to draw), which see ``Schedule`` only for annotations: Note [import layers]
in ``__init__.py``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Iterable, Mapping, Optional, Sequence, Union

from .actions import Action, Kind, flat
from .errors import ScheduleError
from .render import render
from .text import infer_stage_to_rank, parse_actions, split_rank_lines
from .validate import validate

# ScheduleError lives in errors.py; importing it from here keeps working.
__all__ = ["Schedule", "ScheduleError"]


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
        """Per stage, ``Kind.I`` when any of its microbatches' backwards is split into
        I + W, else ``Kind.B`` (every one fused); ``backward_of`` says it per microbatch."""
        kinds = {s: Kind.B for s in range(self.num_stages)}
        for s, _ in self._split:
            kinds[s] = Kind.I
        return kinds

    def backward_of(self, stage: int, microbatch: int) -> Kind:
        """``Kind.I`` when this (stage, microbatch)'s backward is split into I + W, else
        ``Kind.B``: the action whose output the previous stage's backward consumes."""
        return Kind.I if (stage, microbatch) in self._split else Kind.B

    @functools.cached_property
    def _split(self) -> frozenset[tuple[int, int]]:
        return frozenset((a.stage, a.microbatch) for acts in self.ranks for a in flat(acts) if a.kind is Kind.I)

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
        parsed = parse_actions(ranks)
        if stage_to_rank is None:
            stage_to_rank = infer_stage_to_rank(parsed)
        if num_microbatches is None:
            mbs = [a.microbatch for r in parsed for a in flat(r) if a.microbatch is not None]
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
        return cls.from_lists(split_rank_lines(text), num_microbatches, stage_to_rank, name)

    def to_text(self) -> str:
        return "\n".join(" ".join(map(repr, r)) for r in self.ranks)

    def render(self, costs=None, mark: Optional[tuple[int, int]] = None) -> str:
        """A rank x time grid.  See ``schedules.render``."""
        return render(self, costs=costs, mark=mark)

    def __str__(self) -> str:
        return self.render()

