"""Which modules of each pipeline stage are sharded how: the controller's side of tensor
parallelism (``Pipeline(..., tp=T, tp_plan=...)``).

``resolve_plans(stages, tp_plan, tp)`` turns the user's ``tp_plan`` into one plan per
stage, checked against the stage's structure only (names, types, shapes, config: the
controller may hold factory stages on the meta device), so a plan that cannot apply
fails here, before any actor starts, naming the stage and the module.  The actors apply
what it returns with ``apply_plan`` (actors/tensor_parallel.py).  See Note [tensor-parallel
plans].
"""

from __future__ import annotations

import difflib
import inspect
from fnmatch import fnmatch
from typing import Callable, Mapping, Optional, Sequence, Union

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from .builtin import auto_plan
from .ties import check_tied_placements

__all__ = ["resolve_plans", "expand_plan", "check_plan", "StagePlan", "TPPlan"]

# What one stage's actors apply: None (not sharded), {module name: style} with concrete
# names (parallelize_module's dict form), or the user's function.
StagePlan = Union[None, dict, Callable]
# What the user passes: "auto", {name pattern: style}, a function (stage_index, module, mesh) -> None, or None.
TPPlan = Union[None, str, Mapping[str, ParallelStyle], Callable]

# Note [tensor-parallel plans]
# ----------------------------
# A plan says, per stage, which modules are sharded across the stage's T actors (its TP
# group, a 1-D DeviceMesh) and how.  Every actor of the group builds the whole stage
# under the same seed, then ``apply_plan`` (actors/tensor_parallel.py) runs
# ``parallelize_module`` per entry.
# ``resolve_plans`` decides the plans on the controller and checks them there:
#
# * ``tp == 1``: no plan, whatever ``tp_plan`` is (``[None] * stages``).  ``tp > 1`` needs
#   a ``tp_plan``: ``"auto"``, a dict or a function.
# * A dict ``{name: ParallelStyle}`` applies to every stage, names relative to the stage.
#   A name may hold fnmatch wildcards per dotted atom, as ``parallelize_module`` reads
#   them (``"model.layers.*.mlp.gate_proj"``); each stage gets the concrete names its
#   modules match, in the dict's order (a stage where a key matches nothing gets fewer
#   entries; a stage where none matches gets ``{}``, i.e. nothing sharded).  A key that
#   matches no module of any stage is an error with the closest names, so a typo never
#   leaves a layer silently replicated.  Two keys reaching one module are an error
#   (it would be sharded twice).
# * ``ColwiseParallel``/``RowwiseParallel`` are checked: the module is an ``nn.Linear``
#   or ``nn.Embedding`` (all they support) and the dimension they shard divides by T:
#   colwise Linear shards ``out_features`` (weight and bias dim 0), rowwise Linear
#   ``in_features`` (weight dim 1; the bias stays replicated), rowwise Embedding
#   ``num_embeddings`` (vocabulary-parallel, weight dim 0), colwise Embedding
#   ``embedding_dim`` (weight dim 1).  Uneven shards would run (DTensor pads) but break
#   the ``view(..., heads, head_dim)`` of attention layers and are refused.  Other styles
#   (SequenceParallel, PrepareModuleInput, custom ones) pass through unchecked.  Nothing
#   checks that the styles compose (a colwise output is a local shard: the next layer
#   must take it, as a rowwise one does); the exactness tests check the built-in plans.
# * A function ``(stage_index, module, mesh) -> None`` parallelizes each stage itself;
#   it is passed to every stage unchecked (its signature is bound to three arguments).
# * ``"auto"``: the built-in plan of the stage's class (``builtin.py``): Llama-family
#   stages (``LlamaStage``: Llama, Mistral, Qwen2, Qwen3) shard attention q/k/v colwise
#   (whole heads per actor; HF views them as ``(..., -1, head_dim)``) and o rowwise, MLP
#   gate/up colwise and down rowwise, the norms and residual stream over the sequence
#   (Note [sequence parallelism] in builtin.py; the sequence length must divide by T),
#   the embedding vocabulary-parallel (``RowwiseParallel(input_layouts=Replicate())``)
#   and the LM head colwise with its output gathered (``output_layouts=Replicate()``: the
#   loss sees full logits) or, with ``Pipeline(loss_parallel=True)``, sharded over the
#   vocabulary (Note [vocabulary-parallel loss] in builtin.py), plus Qwen3's per-head q/k
#   norms (Note [per-head norms]); the config's heads, key/value heads, intermediate size and vocabulary
#   must divide by T.  ``GPTStage`` shards only the MLP, the token embedding and the
#   head: its attention's one fused ``qkv`` Linear is split into q, k, v by position and
#   viewed with the full head count, so a colwise shard would mix q, k and v; attention
#   (and the position embedding, the norms) stay replicated.  ``GPT2Stage`` (fused
#   ``Conv1D``, not ``nn.Linear``) and every other class are refused with what to pass.
# * Every actor of a group must build the same weights (the same pickled module, or the
#   factory under the same seed): the actors slice each shard from their own copy
#   (``src_data_rank=None``, no scatter) and leave parameters outside the plan as built.
#   The boundary values a stage hands on are plain, replicated tensors (every plan ends
#   in a rowwise layer or a gathered output), so each TP rank sends its own copy to its
#   counterpart.
# * Tied parameters: a parameter two planned modules share (Llama's tied embedding and LM
#   head) must get one placement from both.  The auto Llama plan shards both on dim 0
#   (the embedding rowwise = vocabulary-parallel, the head colwise: both [vocab, hidden]),
#   so the shards are aligned; ``check_tied_placements`` (``ties.py``) refuses a plan
#   where they differ, and ``apply_plan`` re-ties a parameter one stage holds twice,
#   which ``parallelize_module`` would otherwise split into two.  Across stages, the tie
#   reduction sums each TP rank's local shards with its counterpart's, after
#   ``align_grads`` (the embedding's gradient comes back whole: Note [tensor
#   parallelism] in actors/tensor_parallel.py).
#
# Everything returned pickles (styles are plain objects); a function plan ships as the
# stage factories do, by cloudpickle.


def resolve_plans(stages: Sequence[nn.Module], tp_plan: TPPlan, tp: int, *,
                  loss_parallel: bool = False) -> list[StagePlan]:
    """One plan per stage for ``tp`` actors per stage (Note [tensor-parallel plans]):
    ``None`` (not sharded), ``{module name: ParallelStyle}`` with concrete names, or the
    user's function.  Looks at the stages' structure only (they may be on the meta device).
    ``loss_parallel``: the built-in plans leave the LM head's logits sharded over the
    vocabulary (Note [vocabulary-parallel loss] in builtin.py); a dict or function plan says
    its head's output layout itself."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tp must be a positive integer (actors per pipeline stage), got {tp!r}")
    if tp == 1:
        return [None] * len(stages)
    if tp_plan is None:
        raise ValueError(f"tp={tp} needs a tp_plan saying which modules to shard: tp_plan='auto' (the built-in plan "
                         f"of Llama-family and mpmd.models.GPTStage stages), a dict {{module name: ParallelStyle}} "
                         f"such as {{'mlp.0': ColwiseParallel(), 'mlp.2': RowwiseParallel()}}, or a function "
                         f"(stage_index, module, mesh) -> None")
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise ValueError(f"tp_plan={tp_plan!r} is not a plan; use tp_plan='auto', a dict {{module name: "
                             f"ParallelStyle}} or a function (stage_index, module, mesh) -> None")
        plans = [auto_plan(stage, tp, s, loss_parallel=loss_parallel) for s, stage in enumerate(stages)]
        for s, (stage, plan) in enumerate(zip(stages, plans)):
            check_plan(stage, plan, tp, s)
        check_tied_placements(stages, plans)
        return plans
    if isinstance(tp_plan, ParallelStyle):
        raise ValueError(f"tp_plan={tp_plan!r} is one style; give a dict naming the modules it applies to "
                         f"(relative to each stage; '' is the stage itself), e.g. {{'mlp.0': {tp_plan!r}}}")
    if isinstance(tp_plan, Mapping):
        return _resolve_dict(stages, tp_plan, tp)
    if callable(tp_plan):
        _check_signature(tp_plan)
        return [tp_plan] * len(stages)
    raise ValueError(f"tp_plan must be 'auto', a dict {{module name: ParallelStyle}} or a function "
                     f"(stage_index, module, mesh) -> None; got {type(tp_plan).__name__}")


def expand_plan(stage: nn.Module, plan: Mapping[str, ParallelStyle]) -> tuple[dict, dict]:
    """``plan``'s keys expanded to the stage's concrete module names, as ``parallelize_module``
    matches them (fnmatch per dotted atom; ``""`` is the stage itself).  Returns
    ``(concrete plan in the plan's order, {key: names it matched})``; two keys reaching one
    module raise."""
    out: dict = {}
    matched: dict = {}
    owner: dict = {}
    for key, style in plan.items():
        names = _matches(stage, key)
        matched[key] = names
        for name in names:
            if name in out:
                raise ValueError(f"tp_plan keys {owner[name]!r} and {key!r} both reach module {name!r}; a module "
                                 f"can be sharded once: keep one of them, or narrow the wildcard")
            out[name], owner[name] = style, key
    return out, matched


def check_plan(stage: nn.Module, plan: Mapping[str, ParallelStyle], tp: int, stage_index: int) -> None:
    """Each colwise/rowwise entry of a concrete plan fits its module: a supported type and a
    sharded dimension that divides by ``tp`` (Note [tensor-parallel plans])."""
    for name, style in plan.items():
        module = stage.get_submodule(name)
        what = _style_name(style)
        if what is None:
            continue
        where = f"stage {stage_index}, module {name or '(the stage itself)'!r} ({_describe(module)})"
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise ValueError(f"{where}: {what} shards only nn.Linear and nn.Embedding modules; name the Linear "
                             f"layers inside it instead, or use another ParallelStyle (or a function plan) for it")
        field, size = _sharded_dim(module, what)
        if size % tp:
            raise ValueError(f"{where}: {what} shards its {field} ({size}) across tp={tp} actors, but {size} is not "
                             f"divisible by {tp}; use a tp that divides {size}, resize the layer, or leave "
                             f"{name!r} out of the plan (it stays replicated)")


def _resolve_dict(stages: Sequence[nn.Module], tp_plan: Mapping, tp: int) -> list[dict]:
    for key, style in tp_plan.items():
        if not isinstance(key, str):
            raise ValueError(f"tp_plan key {key!r} is not a module name; keys are module names relative to the stage")
        if not isinstance(style, ParallelStyle):
            raise ValueError(f"tp_plan[{key!r}] is {style!r}, not a ParallelStyle; use ColwiseParallel(), "
                             f"RowwiseParallel() or another torch.distributed.tensor.parallel style")
    plans, hits = [], {key: 0 for key in tp_plan}
    for stage in stages:
        plan, matched = expand_plan(stage, tp_plan)
        plans.append(plan)
        for key, names in matched.items():
            hits[key] += len(names)
    for key, n in hits.items():
        if not n:
            raise ValueError(f"tp_plan key {key!r} matches no module of any stage{_suggest(key, stages)}; names are "
                             f"relative to each stage (stage.named_modules()), with '*' matching one dotted part")
    for s, (stage, plan) in enumerate(zip(stages, plans)):
        check_plan(stage, plan, tp, s)
    check_tied_placements(stages, plans)
    return plans


def _matches(module: nn.Module, key: str, prefix: str = "") -> list[str]:
    if key == "":
        return [prefix]
    head, _, rest = key.partition(".")
    out = []
    for name, child in module.named_children():
        if fnmatch(name, head):
            path = f"{prefix}.{name}" if prefix else name
            out += _matches(child, rest, path) if rest else [path]
    return out


def _suggest(key: str, stages: Sequence[nn.Module]) -> str:
    names = {n for stage in stages for n, _ in stage.named_modules() if n}
    # The same names with numeric parts as '*', so a wildcard key finds its wildcard neighbour.
    names |= {".".join("*" if p.isdigit() else p for p in n.split(".")) for n in names}
    close = difflib.get_close_matches(key, sorted(names), n=3, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


def _style_name(style: ParallelStyle) -> Optional[str]:
    if isinstance(style, ColwiseParallel):
        return "ColwiseParallel"
    if isinstance(style, RowwiseParallel):
        return "RowwiseParallel"
    return None


def _sharded_dim(module: nn.Module, what: str) -> tuple[str, int]:
    if isinstance(module, nn.Linear):
        return ("out_features", module.out_features) if what == "ColwiseParallel" else ("in_features",
                                                                                       module.in_features)
    if what == "RowwiseParallel":  # vocabulary-parallel
        return "num_embeddings", module.num_embeddings
    return "embedding_dim", module.embedding_dim


def _describe(module: nn.Module) -> str:
    kind = type(module).__name__
    if isinstance(module, nn.Linear):
        return f"{kind}(in_features={module.in_features}, out_features={module.out_features})"
    if isinstance(module, nn.Embedding):
        return f"{kind}(num_embeddings={module.num_embeddings}, embedding_dim={module.embedding_dim})"
    weight = getattr(module, "weight", None)
    return f"{kind} with weight {tuple(weight.shape)}" if isinstance(weight, nn.Parameter) else kind


def _check_signature(fn: Callable) -> None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return
    try:
        sig.bind(0, nn.Module(), None)
    except TypeError as e:
        raise ValueError(f"tp_plan function {getattr(fn, '__qualname__', fn)!r}{sig} cannot be called as "
                         f"(stage_index, module, mesh): {e}") from None
