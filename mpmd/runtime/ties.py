"""Parameters that several stages share (tied weights), found before anything is shipped.

Each stage is shipped to its actor on its own, so a parameter two stages share arrives
as one copy per stage.  ``find_ties`` lists, per group of stages sharing parameters, each
stage's names for them in one order; the lowering adds a ``TIE_REDUCE`` per group and the
actors sum the copies' gradients there (Note [tie reduction] in schedules/passes.py), so
training equals one shared parameter.  A buffer two stages share is refused: copies of a
buffer a module updates (BatchNorm's running statistics) would drift apart.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from actors.grid import DeviceGrid
from actors.protocol import TieGroup
from schedules import Schedule

__all__ = ["Tie", "find_ties", "tie_groups_of"]


@dataclasses.dataclass(frozen=True)
class Tie:
    """Stages sharing parameters, and each stage's names for them (aligned: the k-th names
    of every stage are one parameter)."""

    stages: tuple[int, ...]
    names: dict  # stage -> tuple of parameter names


def find_ties(stages: Sequence[torch.nn.Module]) -> tuple[Tie, ...]:
    """The ties among ``stages``, in order of their first stage and names."""
    where: dict[int, dict[int, str]] = {}  # id(parameter) -> {stage: its first name there}
    order: dict[int, tuple[int, int]] = {}  # id(parameter) -> (first stage, position): a stable order
    for s, stage in enumerate(stages):
        for i, (name, p) in enumerate(stage.named_parameters(remove_duplicate=False)):
            where.setdefault(id(p), {}).setdefault(s, name)
            order.setdefault(id(p), (s, i))
    _refuse_shared_buffers(stages)
    groups: dict[tuple[int, ...], list[int]] = {}
    for pid, names in where.items():
        if len(names) > 1:
            groups.setdefault(tuple(sorted(names)), []).append(pid)
    ties = []
    for group, pids in sorted(groups.items(), key=lambda kv: min(order[p] for p in kv[1])):
        pids.sort(key=order.get)
        ties.append(Tie(group, {s: tuple(where[p][s] for p in pids) for s in group}))
    return tuple(ties)


def _refuse_shared_buffers(stages: Sequence[torch.nn.Module]) -> None:
    first: dict[int, tuple[int, str]] = {}
    for s, stage in enumerate(stages):
        for name, b in stage.named_buffers(remove_duplicate=False):
            t, n = first.setdefault(id(b), (s, name))
            if t != s:
                raise ValueError(
                    f"stage {t} ({n!r}) and stage {s} ({name!r}) share one buffer; each stage is shipped to its actor "
                    f"as its own copy, and copies of a buffer a module updates (BatchNorm's running statistics) would "
                    f"drift apart. Give each stage its own module (copy.deepcopy) if the buffer is a constant, or keep "
                    f"the modules that use it in one stage")


def tie_groups_of(ties: Sequence[Tie], schedule: Schedule,
                  grid: DeviceGrid) -> tuple[list[list[int]], list[list[TieGroup]]]:
    """The communicator groups of the ties (one per tie spanning ranks, per replica and TP rank,
    in tie order: Note [device grid]) and each actor's ``TieGroup``s."""
    groups: list[list[int]] = []
    actor_ties: list[list[TieGroup]] = [[] for _ in range(grid.size)]
    for g, tie in enumerate(ties):
        ranks = sorted({schedule.stage_to_rank[s] for s in tie.stages})
        for d in range(grid.dp):
            for c, t in ((c, t) for c in range(grid.cp) for t in range(grid.tp)):  # TP rank t's shard meets TP rank t's
                index = -1
                if len(ranks) > 1:
                    index = len(groups)
                    groups.append([grid.actor(d, r, t, c) for r in ranks])
                for r in ranks:
                    local = {s: tie.names[s] for s in tie.stages if schedule.stage_to_rank[s] == r}
                    actor_ties[grid.actor(d, r, t, c)].append(TieGroup(g, local, index, tie.stages[0]))
    return groups, actor_ties
