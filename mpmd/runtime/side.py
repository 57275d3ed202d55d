"""Side inputs: values a step hands to the stages (and the loss) that take them, beside
the pipeline's own flow of activations: attention masks, position ids, a loss mask.

``pipe.step(inputs, targets, attention_mask=mask)``: a tensor whose first dimension is the
batch size is cut into microbatches like the inputs; anything else (a scalar, a tensor
of another leading size) goes whole to every microbatch.  A stage receives, as keyword
arguments, the side values whose names its ``forward`` accepts (all of them with
``**kwargs``); ``loss_fn(output, target, **...)`` likewise.  Side values take no
gradients and travel only to the actors whose stages (or loss) take them, in the step
call, not through the pipeline.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Optional, Sequence

import torch

from actors.values import pack_batch
from actors.grid import DeviceGrid
from schedules import Schedule

__all__ = ["SideSpec", "side_spec", "split_side", "pack_side"]


def _keywords(fn: Callable, skip: int) -> Optional[tuple[str, ...]]:
    """The keyword names ``fn`` accepts after its first ``skip`` positional parameters;
    None when it takes ``**kwargs`` (every name)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): it takes none
        return ()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    skipped = set(positional[:skip])
    return tuple(p.name for p in params
                 if p.name not in skipped and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


@dataclasses.dataclass(frozen=True)
class SideSpec:
    """Which side inputs each stage's ``forward`` and the loss take (None: all)."""

    stages: tuple[Optional[tuple[str, ...]], ...]
    loss: Optional[tuple[str, ...]]

    @staticmethod
    def takes(names: Optional[tuple[str, ...]], name: str) -> bool:
        return names is None or name in names

    def for_stages(self, stages: Sequence[int], with_loss: bool) -> set[str]:
        """The names a set of stages (and the loss, ``with_loss``) could take: None-lists mean all."""
        lists = [self.stages[s] for s in stages] + ([self.loss] if with_loss else [])
        return set().union(*[n for n in lists if n is not None]) if all(n is not None for n in lists) else {"*"}

    def per_actor(self, side: dict, batch: int, schedule: Schedule, dp: int, num_microbatches: int,
                  tp: int = 1, cp: int = 1, always: tuple = ()) -> list:
        """Each actor's share of the side inputs (actors in grid order, Note [device grid]): the
        microbatches of its replica, of the names its stages take (and the loss, on the last
        stage's actors); every TP and CP rank of a stage gets the same (a CP rank shards it itself)."""
        per_mb, whole = split_side(side, batch, num_microbatches * dp)
        grid, last = DeviceGrid(dp=dp, pp=schedule.num_ranks, tp=tp, cp=cp), schedule.stage_to_rank[-1]
        out = []
        for i in range(grid.size):
            replica, rank, _ = grid.coord(i)
            names = self.for_stages(schedule.stages_of(rank), with_loss=rank == last) | set(always)
            out.append(pack_side(per_mb, whole, names, replica * num_microbatches, num_microbatches))
        return out

    def check(self, names: Sequence[str]) -> None:
        """Refuse a side input no stage and no loss takes (a typo would otherwise be dropped)."""
        for name in names:
            if not any(self.takes(t, name) for t in (*self.stages, self.loss)):
                taken = "; ".join(f"stage {s}: {', '.join(t) or 'none'}" for s, t in enumerate(self.stages))
                raise ValueError(f"side input {name!r} is taken by no stage and not by loss_fn (keyword arguments "
                                 f"their signatures accept: {taken}; loss_fn: {', '.join(self.loss or ()) or 'none'}); "
                                 f"rename it or add the parameter to the stage's forward")


def side_spec(stages: Sequence[torch.nn.Module], loss_fn: Optional[Callable]) -> SideSpec:
    return SideSpec(stages=tuple(_keywords(s.forward, 1) for s in stages),
                    loss=_keywords(loss_fn, 2) if loss_fn is not None else ())


def split_side(side: dict, batch: int, parts: int) -> tuple[dict[str, list], dict[str, Any]]:
    """``(per microbatch, whole)``: tensors whose first dimension is ``batch`` cut into
    ``parts`` microbatches, everything else as it is."""
    per_mb, whole = {}, {}
    for name, value in side.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch:
            per_mb[name] = list(value.detach().chunk(parts))
        else:
            whole[name] = value.detach() if isinstance(value, torch.Tensor) else value
    return per_mb, whole


def pack_side(per_mb: dict[str, list], whole: dict[str, Any], names: set[str], start: int,
              count: int) -> Optional[tuple[dict, dict]]:
    """What one actor gets: microbatches ``start .. start+count`` of the side values it takes."""
    def wanted(n: str) -> bool:
        return "*" in names or n in names

    mine = ({n: pack_batch(v[start:start + count]) for n, v in per_mb.items() if wanted(n)},
            {n: v for n, v in whole.items() if wanted(n)})
    return mine if mine[0] or mine[1] else None
