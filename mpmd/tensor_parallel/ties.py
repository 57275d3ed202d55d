"""The placements a plan gives parameters, so that a tied parameter's places are checked on
the controller before anything runs (Note [tensor-parallel plans] in plans.py)."""

from __future__ import annotations

from typing import Mapping, Sequence

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

__all__ = ["param_placements", "check_tied_placements"]

# The placement (as text) each supported style gives a module's parameters; absent: unknown.
_PLACEMENTS = {
    (ColwiseParallel, nn.Linear): {"weight": "Shard(0)", "bias": "Shard(0)"},
    (RowwiseParallel, nn.Linear): {"weight": "Shard(1)", "bias": "Replicate()"},
    (ColwiseParallel, nn.Embedding): {"weight": "Shard(1)"},
    (RowwiseParallel, nn.Embedding): {"weight": "Shard(0)"},  # vocabulary-parallel
}


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
