"""Applying a stage's plan on its actors, and the placements a plan gives parameters, so
that tied parameters can be checked on the controller (Note [tensor-parallel plans] in
plans.py)."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

__all__ = ["apply_plan", "param_placements", "check_tied_placements"]

# The placement (as text) each supported style gives a module's parameters; absent: unknown.
_PLACEMENTS = {
    (ColwiseParallel, nn.Linear): {"weight": "Shard(0)", "bias": "Shard(0)"},
    (RowwiseParallel, nn.Linear): {"weight": "Shard(1)", "bias": "Replicate()"},
    (ColwiseParallel, nn.Embedding): {"weight": "Shard(1)"},
    (RowwiseParallel, nn.Embedding): {"weight": "Shard(0)"},  # vocabulary-parallel
}


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


def param_placements(stage: nn.Module, plan) -> dict:
    """``{parameter name: placement text}`` for the parameters of the modules a concrete dict
    ``plan`` shards with a colwise/rowwise style (``"Shard(0)"``, ``"Replicate()"``), and
    ``None`` for those under another style (not known here).  Parameters of modules the
    plan leaves out are replicated and not listed."""
    out: dict = {}
    for name, style in (plan or {}).items():
        module = stage.get_submodule(name)
        known = next((p for (s, m), p in _PLACEMENTS.items() if isinstance(style, s) and isinstance(module, m)), None)
        for pname, _ in module.named_parameters(recurse=known is None):
            full = f"{name}.{pname}" if name else pname
            if known is not None:
                out[full] = known[pname]
            else:
                out.setdefault(full, None)
    return out


def check_tied_placements(stages: Sequence[nn.Module], plans: Sequence) -> None:
    """Refuse plans that shard one shared parameter (a tie, within a stage or across stages)
    differently in its places, or shard it in one place and not in another (Note
    [tensor-parallel plans]).  Function plans and styles other than colwise/rowwise are not
    known here and are not checked."""
    seen: dict = {}  # id(parameter) -> (stage, name, placement text or None: unknown)
    for s, (stage, plan) in enumerate(zip(stages, plans)):
        if plan is not None and not isinstance(plan, Mapping):
            continue
        placed = param_placements(stage, plan)
        for name, p in stage.named_parameters(remove_duplicate=False):
            where = placed.get(name, "Replicate()")
            first = seen.setdefault(id(p), (s, name, where))
            if first[2] is not None and where is not None and first[2] != where:
                raise ValueError(
                    f"stage {first[0]}'s {first[1]!r} and stage {s}'s {name!r} are one tied parameter, but the plan "
                    f"places it as {first[2]} in one and {where} in the other; the places of a tie must be sharded "
                    f"alike (both on dim 0, as the built-in Llama plan shards a tied embedding and LM head), or "
                    f"both left out of the plan")


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
