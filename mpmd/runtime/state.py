"""The pipeline's state dict: the stages' state dicts under one set of keys.

By default a stage's keys get its index as a prefix, the keys of
``nn.Sequential(*stages).state_dict()``.  When every stage says its keys are already the
model's own (``keeps_model_keys = True``, as ``mpmd.split`` of a Hugging Face model
does), they are used as they are, so ``model.load_state_dict(pipe.state_dict())`` works;
a key several stages hold (a tied weight) is listed once.  And the check that a tie is
sharded alike on all its stages.
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch

from actors.tensor_parallel import TIE_LAYOUT_FIX

from .ties import Tie

__all__ = ["StateKeys", "check_tie_layouts"]


class StateKeys:
    """How the stages' keys map to the pipeline's."""

    def __init__(self, stages: Sequence[torch.nn.Module]) -> None:
        self.model_keys = bool(stages) and all(getattr(s, "keeps_model_keys", False) for s in stages)
        self.stage_keys = [list(s.state_dict()) for s in stages]

    def key(self, stage: int, name: str) -> str:
        return name if self.model_keys else f"{stage}.{name}"

    def merge(self, per_stage: dict[int, dict]) -> "collections.OrderedDict[str, torch.Tensor]":
        """One state dict from ``{stage: its state dict}``."""
        out = collections.OrderedDict()
        for s in sorted(per_stage):
            for name, value in per_stage[s].items():
                out.setdefault(self.key(s, name), value)
        return out

    def split(self, state_dict: dict) -> dict[int, dict]:
        """``{stage: its state dict}`` from one state dict (with every key of ``merge``'s)."""
        return {s: {name: state_dict[self.key(s, name)] for name in names} for s, names in enumerate(self.stage_keys)}

    def tied_keys(self, tie: Tie) -> list[tuple[str, ...]]:
        """Per parameter of the tie, its keys (one per stage, or fewer with model keys)."""
        n = len(tie.names[tie.stages[0]])
        return [tuple(dict.fromkeys(self.key(s, tie.names[s][k]) for s in tie.stages)) for k in range(n)]

    def check_tied_values(self, ties: Sequence[Tie], state_dict: dict) -> None:
        """A ``ValueError`` if the keys of one tied parameter have different values in ``state_dict``."""
        for tie in ties:
            for keys in self.tied_keys(tie):
                if any(not torch.equal(torch.as_tensor(state_dict[keys[0]]), torch.as_tensor(state_dict[k]))
                       for k in keys[1:]):
                    raise ValueError(f"{', '.join(keys)} name one tied parameter, but the state_dict gives them "
                                     f"different values; give them the same value")


def check_tie_layouts(ties: Sequence[Tie], grid, layouts: dict[int, dict]) -> None:
    """Refuse a tie whose stages a TP plan shards differently: ``layouts`` maps the first TP
    rank of each pipeline rank (replica 0) to its ``tie_layouts`` (each actor checks its own
    copies; this compares them across the tie's actors)."""
    seen: dict[int, tuple] = {}
    for i, found in layouts.items():
        for tie, layout in found.items():
            first = seen.setdefault(tie, (grid.rank_of(i), layout))
            if first[1] != layout:
                ranks = sorted(ties[tie].stages)
                raise ValueError(f"the parameters tied between stages {ranks} are sharded differently on rank "
                                 f"{first[0]} ({first[1]}) and rank {grid.rank_of(i)} ({layout}); {TIE_LAYOUT_FIX}")
