"""Applying a stage's plan on its actors (Note [tensor-parallel plans] in plans.py).

Runs on the actors: imports only torch (as grads.py and state.py), so it can move under
``actors/`` as it is."""

from __future__ import annotations

from typing import Mapping, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

__all__ = ["apply_plan"]

def apply_plan(stage_index: int, module: nn.Module, mesh: DeviceMesh, plan, *,
               src_data_rank: Optional[int] = 0) -> nn.Module:
    """Shard ``module`` (stage ``stage_index``, built whole on every actor of the TP group)
    over the 1-D ``mesh`` by its resolved ``plan`` (``resolve_plans``): ``None`` leaves it
    as it is, a dict goes to ``parallelize_module``, a function is called
    ``(stage_index, module, mesh)``.  A parameter the stage holds under two names (a tied
    embedding and head in one stage) is re-tied afterwards: ``parallelize_module``
    replaces each module's parameter with its own DTensor, which would untie them.
    ``src_data_rank=0`` takes every shard from the group's rank 0 (scatter/broadcast), as
    ``parallelize_module`` does by default; ``None`` slices each actor's own copy (no
    communication; right only when every actor built the same weights)."""
    if plan is None:
        return module
    if mesh.ndim != 1:
        raise ValueError(f"stage {stage_index}: a tensor-parallel plan applies over a 1-D mesh (the stage's TP group), "
                         f"got a {mesh.ndim}-D mesh {mesh}; pass mesh[\"tp\"]")
    if not isinstance(plan, Mapping):
        plan(stage_index, module, mesh)
        return module
    tied = _tied_slots(module)
    parallelize_module(module, mesh, dict(plan), src_data_rank=src_data_rank)
    for slots in tied:
        owner, attr, name = slots[0]
        kept = getattr(owner, attr)
        for other, other_attr, other_name in slots[1:]:
            now = getattr(other, other_attr)
            if now is kept:
                continue
            if _placements(now) != _placements(kept):
                raise ValueError(f"stage {stage_index}: the plan shards the tied parameter {name!r} as "
                                 f"{_placements(kept)} but {other_name!r} as {_placements(now)}; shard both alike "
                                 f"(Note [tensor-parallel plans])")
            setattr(other, other_attr, kept)
    return module


def _tied_slots(module: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Groups of (owning module, attribute, full name) holding one parameter, for parameters
    held more than once."""
    slots: dict = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            slots.setdefault(id(p), []).append((sub, attr, f"{mname}.{attr}" if mname else attr))
    out = []
    for group in slots.values():
        unique = list({(id(o), a): (o, a, n) for o, a, n in group}.values())
        if len(unique) > 1:
            out.append(unique)
    return out


def _placements(p) -> str:
    return str(tuple(p.placements)) if hasattr(p, "placements") else "not sharded"
