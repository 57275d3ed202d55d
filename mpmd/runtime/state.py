"""The pipeline's state dict: the stages' state dicts under one set of keys.

By default a stage's keys get its index as a prefix, the keys of
``nn.Sequential(*stages).state_dict()``.  When every stage says its keys are already the
model's own (``keeps_model_keys = True``, as ``mpmd.split`` of a Hugging Face model
does), they are used as they are, so ``model.load_state_dict(pipe.state_dict())`` works;
a key several stages hold (a tied weight) is listed once.  And the actors' RNG states, for
work that runs steps on the actors and then puts them back as they were (``rng_states``,
``set_rng_states``).
"""

from __future__ import annotations

import collections
from typing import Sequence

import torch

from actors.tensor_parallel import TIE_LAYOUT_FIX

from .ties import Tie

__all__ = ["StateKeys", "rng_states", "set_rng_states", "gather_state", "load_state", "check_tie_layouts"]


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


def rng_states(engine) -> list:
    """Every actor's RNG states, in actor order, for ``set_rng_states``."""
    return engine.call_actors("rng_state", what="the actors' RNG states")


def set_rng_states(engine, states: Sequence) -> None:
    """Put back the actors' RNG states ``rng_states`` returned."""
    for i, state in enumerate(states):
        engine.call_actors("set_rng_state", state, what="putting the RNG states back", indices=[i])


def gather_state(engine, method: str) -> dict:
    """``{stage: state}`` from the first replica's actors' ``method`` (``state_dict``,
    ``state_shapes``).  Under TP every actor of a TP group must take part (the state is
    gathered over the group: Note [tensor parallelism] in actors/tensor_parallel.py); TP rank
    0's answer is kept (the others send none)."""
    grid = engine.grid
    indices = [grid.actor(0, r, t) for r in range(grid.pp) for t in range(grid.tp)]
    parts = engine.call_actors(method, what=method, indices=indices)
    return {s: st for i, part in zip(indices, parts) if grid.coord(i).tp == 0 for s, st in part.items()}


def load_state(engine, state_dict: dict) -> None:
    """Send each actor its stages' part of a (checked) pipeline state dict: each stage's part
    goes into Ray's object store once, whichever replicas and TP ranks read it."""
    import ray

    engine.state_keys.check_tied_values(engine.ties, state_dict)
    refs = {s: ray.put(part) for s, part in engine.state_keys.split(state_dict).items()}
    calls = []
    for i, a in enumerate(engine.actors):
        stages = list(engine.schedule.stages_of(engine.rank_of(i)))
        calls.append(a.load_state_dict.remote(stages, *[refs[s] for s in stages]))
    engine.wait(calls, "load_state_dict")


def check_tie_layouts(engine) -> None:
    """Refuse a tie whose stages a TP plan shards differently (each actor checks its own
    copies; this compares them across the tie's actors)."""
    if engine.config.tp == 1 or not engine.ties:
        return
    grid = engine.grid
    indices = [grid.actor(0, r, 0) for r in range(grid.pp)]
    seen: dict[int, tuple] = {}
    for i, layouts in zip(indices, engine.call_actors("tie_layouts", what="checking the ties", indices=indices)):
        for tie, layout in layouts.items():
            first = seen.setdefault(tie, (grid.rank_of(i), layout))
            if first[1] != layout:
                ranks = sorted(engine.ties[tie].stages)
                raise ValueError(f"the parameters tied between stages {ranks} are sharded differently on rank "
                                 f"{first[0]} ({first[1]}) and rank {grid.rank_of(i)} ({layout}); {TIE_LAYOUT_FIX}")
