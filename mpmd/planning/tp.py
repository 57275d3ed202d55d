"""What a tensor-parallel plan does to a module's per-rank costs, as planning models it:
which parameters it shards and how many all-reduces a forward and a backward run.

Note [TP cost model]
--------------------
Planning does not shard anything: it reads the plan (``Pipeline(tp_plan=...)``) over a
module's submodule names and counts.  A module under ``RowwiseParallel`` ends with one
all-reduce of its output in the forward (attention's output projection, the MLP's down
projection; a vocabulary-parallel embedding) and none in the backward (its input gradient is
sharded like its input).  A linear under ``ColwiseParallel`` takes a replicated input, whose
gradient DTensor all-reduces in the backward, once per such linear, unless the plan made the
block's input a replicated DTensor once (``PrepareModuleInput``, as the built-in Llama plan does
for attention and MLP): then once per block (counted with torch's ``CommDebugMode``: a Llama
layer runs 2 forward and 2 backward all-reduces, 5 without the prepared blocks; the demo GPT's
block, attention whole, 1 and 1), and a column-parallel LM head 1.  The forward adds nothing for a column-parallel linear but the head's all-gather
of its logits, which is not charged (its bytes are the vocabulary's, not the hidden size's).
Everything a plan shards counts ``1 / tp`` per rank, for parameters (and their gradients
and optimizer state) and for compute alike (compute is taken as proportional to the
parameters' share: norms, residuals, positions stay whole; attention's score matmuls
follow its heads, which the projections shard).  Each all-reduce moves one microbatch's
activation between the layers (batch x seq x hidden), ``Costs.tp_collective`` (Note
[runtime costs] in schedules/costs.py).

Under the built-in Llama plan's sequence parallelism (Note [sequence parallelism] in
mpmd/tensor_parallel/builtin.py) each all-reduce is an all-gather one way and a
reduce-scatter the other, which move what the all-reduce moved: the count stands (the stage
edges' gathers, half an all-reduce each, are left out).  Assumed, or left out: activations
are counted whole on every rank here (the estimate is on the high side; the dry run of
``mpmd train`` counts them sharded); collectives never overlap compute; the LM head's
all-gathered logits are not charged.  A plan given as a
function cannot be read without running it: planning reads the built-in ``"auto"``
plan's module names instead (Llama's q/k/v/o and gate/up/down, ``mpmd.models.GPTStage``'s
MLP, the token embeddings and the LM head).  The Pipeline hands planning the plans
``mpmd.tensor_parallel.resolve_plans`` resolved (concrete names, exactly what the actors
apply); called alone, planning matches ``"auto"`` by those names and a dict's patterns.

Each TP rank is assumed to have a device of its own, and a TP all-reduce to cost what the
point-to-point constants of measure.py say (``DEFAULT_LATENCY_S``, ``DEFAULT_BYTES_PER_S``
for the device kind; not measured).  Neither holds on this 2-core VM: the demo GPT
(d_model 128, 4 layers, 2 stages, 1f1b, m=4, batch 8 x 64 tokens) was predicted 0.86x as
long per step at tp=2 as at tp=1 and measured 2.38x (85.7 against 203.7 ms: 4 actors on 2
cores, gloo all-reduces over loopback).  The calibrated auto (Note [calibrated auto] in
replan.py) runs trials at the tp of the plans it tries and corrects from what one TP rank
measured (``StageCost.on_tp_rank``), so a tp that is slow on the machine loses there.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
from typing import Any, Optional

from torch import nn

__all__ = ["TPProfile", "tp_profile", "tp_candidates", "per_rank_share", "collective_seconds"]

# The built-in "auto" plans' modules (mpmd/tensor_parallel/builtin.py), by the last one or
# two atoms of their names: Llama-family stages and mpmd.models.GPTStage (its MLP only).
_ROW = ("o_proj", "down_proj", "mlp.2")  # row-parallel linears: an all-reduce after each
_COL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "mlp.0", "lm_head", "out")
_VOCAB = ("embed_tokens", "tok")  # vocabulary-parallel embeddings (row-wise): one all-reduce
_SHARDABLE = (nn.Linear, nn.Embedding)  # what ColwiseParallel / RowwiseParallel apply to


@dataclasses.dataclass(frozen=True)
class TPProfile:
    """A module under a TP plan: its parameters, those the plan shards, and the TP
    all-reduces of one forward and one input-gradient backward (Note [TP cost model])."""

    params: int = 0
    sharded: int = 0
    forward: int = 0
    backward: int = 0

    @property
    def share(self) -> float:
        """The share of the parameters (and of the compute) the plan divides by ``tp``."""
        return self.sharded / self.params if self.params else 0.0

    def per_rank(self, tp: int) -> float:
        """Parameters one of ``tp`` ranks holds: the unsharded whole, the sharded ``1 / tp``."""
        return float(self.params) if tp == 1 else self.params - self.sharded + self.sharded / tp

    def __add__(self, other: "TPProfile") -> "TPProfile":
        return TPProfile(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def per_rank_share(share: float, tp: int) -> float:
    """What one of ``tp`` ranks computes (or holds) of a whole whose ``share`` is sharded."""
    return 1.0 if tp == 1 else 1.0 - share + share / tp


def tp_profile(module: nn.Module, tp_plan: Any = "auto", *, layer: bool = False) -> TPProfile:
    """``module``'s ``TPProfile`` under ``tp_plan``: ``"auto"`` (or a function, read as
    ``"auto"``), a dict ``{module name pattern: ParallelStyle}`` (names relative to the
    module, ``*`` as ``parallelize_module`` takes it; a resolved plan's concrete names), or
    None (nothing sharded).  ``layer``: ``module`` is one layer of a stage not cut yet
    (``mpmd.split``), so a pattern longer than a name matches by its last atoms."""
    params = sum(p.numel() for p in module.parameters())
    if tp_plan is None:
        return TPProfile(params=params)
    styles = tp_plan if isinstance(tp_plan, dict) else None
    if styles is None and not (tp_plan == "auto" or callable(tp_plan)):
        raise ValueError(f"tp_plan must be 'auto', a dict {{module name: ParallelStyle}} or a function "
                         f"(stage_index, module, mesh) -> None, got {tp_plan!r}")
    sharded = forward = backward = 0
    seen: set[int] = set()
    prepared = _prepared(module, styles)
    backward += len(prepared)
    for name, sub in module.named_modules():
        kind = _style_of(name, sub, styles, layer)
        if kind is None or id(sub) in seen:
            continue
        seen.add(id(sub))
        sharded += sum(p.numel() for p in sub.parameters())
        if kind == "row":
            forward += 1
        elif isinstance(sub, nn.Linear) and not any(name.startswith(f"{p}.") for p in prepared):
            backward += 1  # its replicated input's gradient, all-reduced on its own
    return TPProfile(params=params, sharded=sharded, forward=forward, backward=backward)


def _prepared(module: nn.Module, styles: Optional[dict]) -> list[str]:
    """The blocks whose input a plan makes a replicated DTensor once, so that their column-parallel
    linears share one input-gradient all-reduce: a dict's ``PrepareModuleInput`` entries (without
    local output); for ``"auto"`` the Llama-family attention and MLP (Note [one input-gradient
    all-reduce per block] in mpmd/tensor_parallel/builtin.py)."""
    if styles is not None:
        return [n for n, st in styles.items() if type(st).__name__ == "PrepareModuleInput"
                and not getattr(st, "use_local_output", True)]
    return [n for n, sub in module.named_modules()
            if n and any(hasattr(sub, c) for c in ("q_proj", "gate_proj")) and n.split(".")[-1] in ("self_attn", "mlp")]


def _style_of(name: str, module: nn.Module, styles: Optional[dict], layer: bool = False) -> Optional[str]:
    """"row", "col" or None: how the plan shards the module called ``name`` (the styles
    apply to linears and embeddings only)."""
    if not name or not isinstance(module, _SHARDABLE):
        return None
    if styles is not None:
        for pattern, style in styles.items():
            if _matches(name, pattern, layer):
                kind = type(style).__name__
                return "row" if "Rowwise" in kind else "col" if "Colwise" in kind else None
        return None
    atoms = name.split(".")
    tail1, tail2 = atoms[-1], ".".join(atoms[-2:])
    if isinstance(module, nn.Embedding):
        return "row" if tail1 in _VOCAB else None
    if tail1 in _ROW or tail2 in _ROW:
        return "row"
    return "col" if tail1 in _COL or tail2 in _COL else None


def _matches(name: str, pattern: str, layer: bool) -> bool:
    """``parallelize_module``'s match, atom by atom (``*`` within one); for a ``layer``, a
    pattern longer than the name matches by its last atoms: ``mpmd.split`` profiles a layer
    outside its stage, where the stage's prefix (``"0."``, ``"model.layers.3."``) is not known yet."""
    atoms, want = name.split("."), pattern.split(".")
    if len(want) < len(atoms) or (len(want) > len(atoms) and not layer):
        return False
    return all(fnmatch.fnmatchcase(a, w) for a, w in zip(atoms, want[len(want) - len(atoms):]))


def tp_candidates(tp: Any) -> tuple[int, ...]:
    """The tensor-parallel degrees to plan for: ``tp`` (an int) or its choices (a tuple)."""
    values = (tp,) if isinstance(tp, int) and not isinstance(tp, bool) else tuple(tp)
    if not values or any(not isinstance(t, int) or isinstance(t, bool) or t < 1 for t in values):
        raise ValueError(f"tp must be a positive integer or a tuple of them (the choices), got {tp!r}")
    return tuple(sorted(set(values)))


def collective_seconds(nbytes: float, tp: int, count: float, latency: float, bytes_per_s: float) -> float:
    """``count`` ring all-reduces of ``nbytes`` over ``tp`` ranks (``Costs.tp_collective``)."""
    if tp <= 1 or not count:
        return 0.0
    ring = 2.0 * (tp - 1) / tp * nbytes
    return count * (latency + (ring / bytes_per_s if ring and math.isfinite(bytes_per_s) else 0.0))
