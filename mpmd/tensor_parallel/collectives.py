"""The collectives a stage's plan costs per microbatch, read from the plan and the module
shapes (for the simulator's TP term, issue 32's "planning sees it"): what
``parallelize_module``'s colwise/rowwise styles run, checked against torch's
``CommDebugMode`` in the two-process test."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleInputOutput,
                                               PrepareModuleOutput, RowwiseParallel, SequenceParallel)

__all__ = ["Collective", "TPCollectives", "tp_collectives"]


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective over the TP group: ``kind`` "all_reduce", "all_gather" or
    "reduce_scatter", for ``module``,
    of a full tensor with ``elements_per_token`` elements per token of the microbatch."""

    kind: str
    module: str
    elements_per_token: int


@dataclasses.dataclass(frozen=True)
class TPCollectives:
    """A stage's TP collectives per microbatch, in the forward and in the backward;
    ``per_step``: once per step, the all-reduce of a replicated weight's pending gradient
    sum when ``align_grads`` (actors/tensor_parallel.py) lays it out (``elements_per_token``
    is then the weight's size); ``unknown``: the modules under styles not modelled here
    (their collectives are not counted)."""

    forward: tuple = ()
    backward: tuple = ()
    per_step: tuple = ()
    unknown: tuple = ()

    def counts(self) -> dict:
        """``{("forward" | "backward", kind): how many}``."""
        out: dict = {}
        for phase in ("forward", "backward", "per_step"):
            for c in getattr(self, phase):
                out[(phase, c.kind)] = out.get((phase, c.kind), 0) + 1
        return out

    def elements_per_token(self, phase: str) -> int:
        """Full-tensor elements per token over ``phase``'s collectives (times tokens and the
        dtype's bytes: what an all-reduce reduces; a ring moves 2 (T-1)/T of it per actor)."""
        return sum(c.elements_per_token for c in getattr(self, phase))


def tp_collectives(stage: nn.Module, plan) -> TPCollectives:
    """The collectives ``plan`` (a resolved dict; None: none) costs ``stage`` per microbatch:
    a colwise Linear all-reduces its input's gradient in the backward (and all-gathers its
    output when the output is replicated), unless a block above it prepared its input (then
    the block does it once for all its colwise linears); a rowwise Linear or a vocabulary-parallel
    Embedding all-reduces its output in the forward.  Under sequence parallelism (Note
    [sequence parallelism] in builtin.py) an all-reduce becomes a reduce-scatter one way and
    an all-gather the other: a block gathers its input over the sequence in the forward and
    reduce-scatters its gradient, a rowwise Linear with a sequence-sharded output
    reduce-scatters it and gathers its gradient; a stage's first layer gathers its input's
    gradient, its last gathers its output.  Every TP rank runs each of them."""
    if not isinstance(plan, Mapping):
        return TPCollectives(unknown=("(function plan)",) if plan is not None else ())
    fwd, bwd, step, unknown = [], [], [], []
    # A block whose input is made a replicated DTensor once (PrepareModuleInput, use_local_output=False):
    # its column-parallel linears' input gradients add up there, one collective for all of them.
    prepared = [n for n, st in plan.items() if isinstance(st, PrepareModuleInput) and not st.use_local_output]
    for name, style in plan.items():
        module = stage.get_submodule(name)
        kind = (type(style), type(module))
        if name in prepared:
            width = next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), 0)
            if _is(_inputs(style), Shard):  # gathered over the sequence
                fwd.append(Collective("all_gather", name, width))
                bwd.append(Collective("reduce_scatter", name, width))
            else:
                bwd.append(Collective("all_reduce", name, width))
        elif isinstance(style, (PrepareModuleInput, PrepareModuleOutput, PrepareModuleInputOutput)):
            width = _hidden(module)
            if _resharded(style, "input"):  # a replicated input cut: its gradient gathered back
                bwd.append(Collective("all_gather", name, width))
            if _resharded(style, "output"):  # a sequence-sharded output gathered whole
                fwd.append(Collective("all_gather", name, width))
            if not (_resharded(style, "input") or _resharded(style, "output")):
                unknown.append(f"{name} ({kind[0].__name__} on {kind[1].__name__})")
        elif isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear) and \
                any(name.startswith(f"{p}.") for p in prepared):
            if _is(style.output_layouts, Replicate):
                fwd.append(Collective("all_gather", name, module.out_features))
        elif isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear) and _is(style.input_layouts, Shard):
            fwd.append(Collective("all_gather", name, module.in_features))  # its input, over the sequence
            bwd.append(Collective("reduce_scatter", name, module.in_features))
            if _is(style.output_layouts, Replicate):
                fwd.append(Collective("all_gather", name, module.out_features))
            fwd += _vocabulary_parallel_loss(style, name)
        elif isinstance(style, ColwiseParallel) and isinstance(module, nn.Linear) and _is(style.input_layouts, Replicate):
            bwd.append(Collective("all_reduce", name, module.in_features))
            if _is(style.output_layouts, Replicate):
                fwd.append(Collective("all_gather", name, module.out_features))
            elif not _is(style.output_layouts, Shard):
                unknown.append(name)
            fwd += _vocabulary_parallel_loss(style, name)
        elif isinstance(style, ColwiseParallel) and isinstance(module, nn.Embedding):
            if _is(style.output_layouts, Replicate):
                fwd.append(Collective("all_gather", name, module.embedding_dim))
        elif isinstance(style, RowwiseParallel) and isinstance(module, (nn.Linear, nn.Embedding)) and \
                (_is(style.output_layouts, Replicate) or _is(style.output_layouts, Shard)):
            width = module.out_features if isinstance(module, nn.Linear) else module.embedding_dim
            if _is(style.output_layouts, Replicate):
                fwd.append(Collective("all_reduce", name, width))
            else:  # onto the sequence shards
                fwd.append(Collective("reduce_scatter", name, width))
                bwd.append(Collective("all_gather", name, width))
        elif isinstance(style, SequenceParallel) and not _has_children(module):
            # Its input and output change layout locally; its weights' gradients are pending sums.
            step += [Collective("all_reduce", f"{name}.{n}", p.numel()) for n, p in module.named_parameters()]
        else:
            unknown.append(f"{name} ({kind[0].__name__} on {kind[1].__name__})")
    return TPCollectives(tuple(fwd), tuple(bwd), tuple(step), tuple(unknown))


def _vocabulary_parallel_loss(style, name: str) -> list:
    """A head whose logits stay sharded over the vocabulary, a DTensor (Note [vocabulary-parallel
    loss] in builtin.py): ``vocab_parallel_cross_entropy`` (actors/vocab_loss.py) all-reduces each token's
    row maximum, then its sum of exponentials and target logit (two elements per token; torch's
    ``F.cross_entropy`` under ``loss_parallel()`` runs three all-reduces of one)."""
    if _is(style.output_layouts, Shard) and not style.use_local_output:
        return [Collective("all_reduce", f"{name} (loss)", 1), Collective("all_reduce", f"{name} (loss)", 2)]
    return []


def _inputs(style) -> tuple:
    """A PrepareModuleInput's input layouts, positional or its one keyword's."""
    kwargs = getattr(style, "input_kwarg_layouts", None) or {}
    return style.input_layouts if style.input_layouts is not None else tuple(kwargs.values())


def _resharded(style, side: str) -> bool:
    """Whether a Prepare* style moves the ``side`` ("input" or "output") between replicated
    and sequence-sharded: a replicated input cut into shards, or a sharded output gathered."""
    style = getattr(style, f"prepare_module_{side}", style)  # PrepareModuleInputOutput's halves
    if side == "input":
        have, want = getattr(style, "input_layouts", None), getattr(style, "desired_input_layouts", None)
        return have is not None and want is not None and _is(have, Replicate) and _is(want, Shard)
    have, want = getattr(style, "output_layouts", None), getattr(style, "desired_output_layouts", None)
    return have is not None and want is not None and _is(have, Shard) and _is(want, Replicate)


def _hidden(module: nn.Module) -> int:
    """The hidden size a decoder layer's input and output carry: its first Linear's input width."""
    return next((m.in_features for m in module.modules() if isinstance(m, nn.Linear)), 0)


def _has_children(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _is(layouts, placement_type) -> bool:
    layouts = layouts if isinstance(layouts, tuple) else (layouts,)
    return len(layouts) == 1 and isinstance(layouts[0], placement_type)
