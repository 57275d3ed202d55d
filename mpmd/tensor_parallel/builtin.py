"""The built-in plans of ``tp_plan="auto"``, per stage class (Note [tensor-parallel plans]
in plans.py): Llama-family Hugging Face stages and the demo ``GPTStage``.  Each returns
concrete module names; ``plans.check_plan`` then checks every entry's type and shape."""

from __future__ import annotations

from typing import Any, Optional

import torch

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel)

from ..models.gpt import Block, Embedding, GPTStage, Head
from ..planning.hf import GPT2Stage, LlamaStage

__all__ = ["auto_plan", "llama_plan", "gpt_plan"]


def auto_plan(stage: nn.Module, tp: int, stage_index: int, *, loss_parallel: bool = False) -> dict:
    """The built-in plan of ``stage``'s class, with concrete module names; ``loss_parallel``:
    a last stage's logits stay sharded over the vocabulary (Note [vocabulary-parallel loss])."""
    if isinstance(stage, GPT2Stage):
        raise ValueError(
            f"stage {stage_index} is a GPT2Stage (Hugging Face GPT-2), which has no built-in tensor-parallel plan: "
            f"its attention and MLP use transformers' Conv1D (c_attn holds q, k and v in one transposed weight), "
            f"which ColwiseParallel/RowwiseParallel cannot shard (they take nn.Linear and nn.Embedding). Pass "
            f"tp_plan as a dict for the modules they can shard, e.g. {{'transformer.wte': "
            f"RowwiseParallel(input_layouts=Replicate()), 'lm_head': ColwiseParallel(output_layouts=Replicate())}}, "
            f"or a function (stage_index, module, mesh) -> None that shards the Conv1D layers itself")
    if isinstance(stage, LlamaStage):
        return llama_plan(stage, tp, stage_index, loss_parallel=loss_parallel)
    if isinstance(stage, GPTStage):
        return gpt_plan(stage, tp, stage_index, loss_parallel=loss_parallel)
    kind = f"{type(stage).__module__}.{type(stage).__qualname__}"
    raise ValueError(
        f"stage {stage_index} is a {kind}, for which there is no built-in tensor-parallel plan (tp_plan='auto' knows "
        f"Llama-family stages of mpmd.split (Llama, Mistral, Qwen2, Qwen3) and mpmd.models.GPTStage); pass tp_plan "
        f"as a dict {{module name: ParallelStyle}}, e.g. {{'mlp.up': ColwiseParallel(), 'mlp.down': "
        f"RowwiseParallel()}}, or a function (stage_index, module, mesh) -> None")


def llama_plan(stage: LlamaStage, tp: int, stage_index: int, *, loss_parallel: bool = False) -> dict:
    """Attention q/k/v colwise (whole heads per actor), o rowwise; MLP gate/up colwise, down
    rowwise; the norms and the residual stream sequence-parallel (Note [sequence
    parallelism]); the embedding vocabulary-parallel; the LM head colwise, its logits
    gathered or, with ``loss_parallel``, left sharded over the vocabulary."""
    config = stage.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    fields = [("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", kv_heads),
              ("intermediate_size", config.intermediate_size)]
    base = stage.model
    ends = hasattr(base, "embed_tokens") or hasattr(stage, "lm_head")
    _check_fields(type(config).__name__, fields + ([("vocab_size", config.vocab_size)] if ends else []), tp,
                  stage_index)
    plan: dict = {}
    if hasattr(base, "embed_tokens"):
        plan["model.embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
    layers = list(base.layers)
    last = hasattr(stage, "lm_head")
    for n, i in enumerate(layers):
        at = f"model.layers.{i}"
        edge = _sequence_edges(tp, stage_index, enter=n == 0, leave=n == len(layers) - 1 and not last)
        if edge is not None:
            plan[at] = edge
        plan[f"{at}.input_layernorm"] = SequenceParallel()
        plan[f"{at}.post_attention_layernorm"] = SequenceParallel()
        # Note [one input-gradient all-reduce per block]: here a reduce-scatter, the block's input
        # gathered from its sequence shards once for its column-parallel linears.
        plan[f"{at}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                     use_local_output=False)
        plan[f"{at}.mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                               use_local_output=False)
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{at}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"{at}.self_attn.o_proj"] = RowwiseParallel(output_layouts=Shard(1))
        attn = base.layers[i].self_attn
        for norm in ("q_norm", "k_norm"):  # Qwen3: Note [per-head norms]
            if hasattr(attn, norm):
                plan[f"{at}.self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[f"{at}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.down_proj"] = RowwiseParallel(output_layouts=Shard(1))
    if last:
        if layers:  # the residual stream arrives sharded over the sequence
            plan["model.norm"] = SequenceParallel()
        plan["lm_head"] = _head(input_layouts=Shard(1) if layers else Replicate(), loss_parallel=loss_parallel)
    _check_present(stage, plan, stage_index)
    return plan


def _head(*, input_layouts, loss_parallel: bool) -> ColwiseParallel:
    """The LM head, column-parallel over the vocabulary: its logits gathered (every TP rank
    gets them whole), or left sharded as a DTensor for a vocabulary-parallel loss."""
    if loss_parallel:
        return ColwiseParallel(input_layouts=input_layouts, output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(input_layouts=input_layouts, output_layouts=Replicate())


def _sequence_edges(tp: int, stage_index: int, *, enter: bool, leave: bool) -> Optional[ParallelStyle]:
    """The style of a stage's first and last decoder layer: the replicated hidden state a
    stage takes is cut into this rank's sequence shard on the way in (no communication;
    ``SequenceShard`` checks the length divides), and gathered whole on the way out of a
    stage that hands it on."""
    if enter and leave:
        return _SequenceShardInputOutput(tp, stage_index)
    if enter:
        return SequenceShard(tp, stage_index)
    if leave:
        return PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                   use_local_output=True)
    return None


class SequenceShard(PrepareModuleInput):
    """A decoder layer's hidden-state input, replicated, cut to this rank's shard of the
    sequence (dim 1).  An uneven cut would make DTensor read the shards as equal ones, so a
    sequence length ``tp`` does not divide is refused with what to change."""

    def __init__(self, tp: int, stage_index: int) -> None:
        super().__init__(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True)
        self.tp, self.stage_index = tp, stage_index

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_pre_hook(SequenceLengthCheck(self.tp, self.stage_index))
        return super()._apply(module, device_mesh)


class _SequenceShardInputOutput(PrepareModuleInputOutput):
    """``SequenceShard`` in (its sequence length checked alike), and the output gathered whole
    (a stage of one decoder layer)."""

    def __init__(self, tp: int, stage_index: int) -> None:
        super().__init__(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_input=True,
                         output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True)
        self.tp, self.stage_index = tp, stage_index

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_pre_hook(SequenceLengthCheck(self.tp, self.stage_index))
        return super()._apply(module, device_mesh)


class SequenceLengthCheck:
    """A forward pre-hook (a class, so the module still pickles) refusing a sequence length
    the TP group cannot cut evenly."""

    def __init__(self, tp: int, stage_index: int) -> None:
        self.tp, self.stage_index = tp, stage_index

    def __call__(self, module: nn.Module, args: tuple) -> None:
        hidden = args[0] if args else None
        if isinstance(hidden, torch.Tensor) and hidden.dim() >= 2 and hidden.shape[1] % self.tp:
            raise ValueError(f"stage {self.stage_index}: the built-in Llama plan shards the sequence over tp="
                             f"{self.tp} actors (sequence parallelism), but this microbatch has {hidden.shape[1]} "
                             f"tokens, not divisible by {self.tp}; pad or cut sequences to a multiple of {self.tp} "
                             f"(under cp > 1 these are a CP rank's S/cp tokens: S must divide by cp x {self.tp} "
                             f"and by 2 x cp)")


# Note [sequence parallelism]
# ---------------------------
# Outside the sharded matmuls a decoder layer's work is per token: the RMSNorms, the
# residual adds.  Replicated, every TP rank would hold them (and what their backward
# keeps) for the whole sequence; the built-in Llama plan shards them over the sequence
# instead, as Megatron's sequence parallelism and torchtitan's plans do.  Between blocks
# the residual stream is this rank's ``1 / tp`` of the tokens (plain local tensors, dim 1);
# the norms are ``SequenceParallel`` (their weight a replicated DTensor whose gradient
# comes back as a pending sum that ``align_grads`` all-reduces once per step); attention
# and the MLP gather their normalized input over the sequence once (``PrepareModuleInput``
# from ``Shard(1)`` to ``Replicate``: an all-gather forward, a reduce-scatter of its gradient
# backward); o_proj and down_proj reduce-scatter their partial sums onto the sequence shards
# (``RowwiseParallel(output_layouts=Shard(1))``) where an all-reduce stood before.  An
# all-gather plus a reduce-scatter move what one all-reduce moves, so the planning cost
# model's count of all-reduces holds (Note [TP cost model] in mpmd/planning/tp.py).
# The stage's edges stay replicated, so nothing outside the stage changes: the first layer
# cuts the replicated hidden state into its shard (no communication; its gradient is
# all-gathered back), the stage computes the masks and rotary embeddings from the whole
# sequence as before, and a stage that hands its hidden state on gathers it whole after its
# last layer; a last stage keeps it sharded through the final norm, and the LM head gathers
# its input.  The sums are the replicated plan's, per token, so the losses are one
# process's (test_tp_exact.py).  The sequence length must divide by ``tp``.

# Note [vocabulary-parallel loss]
# -------------------------------
# The LM head is column-parallel over the vocabulary; gathered (the default), every TP rank
# holds the whole microbatch's logits, the loss's float32 copy and log-softmax, and their
# gradients: at 70B and tp=8 about 21 GB per rank, where an eighth would do.  With
# ``Pipeline(loss_parallel=True)`` the head leaves its logits a DTensor sharded on the
# vocabulary (``Shard(-1)``) and the last stage's actors run ``loss_fn`` and every backward
# through it under torch's ``loss_parallel()``: ``cross_entropy`` (``log_softmax`` +
# ``nll_loss``) on the shards reduces the row maxima, the sums of exponentials and the
# target logits over the TP group (three all-reduces of one number per token) and no rank
# builds the whole row.  ``loss_fn`` then gets a DTensor: reshapes, ``.float()``,
# ``cross_entropy`` (mean, sum, ``ignore_index``) work on it; an op DTensor cannot run on a
# vocabulary shard raises, naming it.  The loss comes back replicated, the same on every TP rank.


# Note [one input-gradient all-reduce per block]
# ----------------------------------------------
# A column-parallel linear fed a plain tensor makes it a replicated DTensor on its own, and
# its input gradient (a partial sum over the TP ranks' output features) is all-reduced on its
# own: q, k and v, gate and up would run five all-reduces per decoder layer in the backward
# (counted with torch's CommDebugMode).  ``PrepareModuleInput(..., use_local_output=False)``
# on ``self_attn`` and ``mlp`` makes the block's input a replicated DTensor once; its
# consumers' partial input gradients add up on it and one all-reduce turns the sum
# replicated: two per layer, as Megatron runs.  The sum is the same, in another order.  On
# this project's 2-core VM (HF Llama d=128, 4 layers, pp=2, tp=2, 4 microbatches of 2 x 64
# tokens, AdamW; one run, medians of 20 steps, 3 pipelines alive): 352 ms per step against
# 481 ms with one all-reduce per linear (0.73x); tp=1: 52 ms.

# Note [per-head norms]
# ---------------------
# Qwen3 normalizes each head's q and k (``q_norm``/``k_norm``, an RMSNorm over head_dim
# with one weight all heads share) on ``q_proj(x).view(batch, seq, heads, head_dim)``.
# With q/k colwise each actor holds only its heads, so that weight's gradient from one
# actor is a partial sum over its heads; left out of the plan, the replicated weight
# would step on a partial gradient and the actors' copies would drift apart.
# ``SequenceParallel(sequence_dim=2)`` is the style that says it: the input is sharded
# on dim 2 (the heads) and the weight is a replicated DTensor, whose gradient comes back
# as a pending sum (Partial) that ``align_grads`` (actors/tensor_parallel.py) all-reduces
# over the group.  ``use_local_output`` hands attention a plain tensor again.


def gpt_plan(stage: GPTStage, tp: int, stage_index: int, *, loss_parallel: bool = False) -> dict:
    """The MLP (first Linear colwise, second rowwise), the token embedding vocabulary-parallel
    and the head colwise with its logits gathered.  Attention stays replicated: its one
    fused ``qkv`` Linear is split into q, k, v by position and viewed with the full head
    count, so a colwise shard would mix q, k and v."""
    plan: dict = {}
    for i, layer in enumerate(stage):
        if isinstance(layer, Embedding):
            _check_fields("GPTConfig", [("vocab_size", layer.tok.num_embeddings)], tp, stage_index)
            plan[f"{i}.tok"] = RowwiseParallel(input_layouts=Replicate())
        elif isinstance(layer, Block):
            _check_fields("GPTConfig", [("4 * d_model", layer.mlp[0].out_features)], tp, stage_index)
            plan[f"{i}.mlp.0"] = ColwiseParallel()
            plan[f"{i}.mlp.2"] = RowwiseParallel()
        elif isinstance(layer, Head):
            _check_fields("GPTConfig", [("vocab_size", layer.out.out_features)], tp, stage_index)
            plan[f"{i}.out"] = _head(input_layouts=Replicate(), loss_parallel=loss_parallel)
    return plan


def _check_fields(config: str, fields: list[tuple[str, Any]], tp: int, stage_index: int) -> None:
    for field, value in fields:
        if value % tp:
            raise ValueError(f"stage {stage_index}: tp_plan='auto' shards {config}.{field} ({value}) across tp={tp} "
                             f"actors, but {value} is not divisible by {tp}; use a tp that divides it, change the "
                             f"model's {field}, or pass a dict plan that leaves those layers replicated")


def _check_present(stage: nn.Module, plan: dict, stage_index: int) -> None:
    for name in plan:
        try:
            stage.get_submodule(name)
        except AttributeError:
            raise ValueError(f"stage {stage_index} ({type(stage).__name__}) has no module {name!r}, which the built-in "
                             f"Llama-family plan shards; this layout differs from Llama's, so pass tp_plan as a dict "
                             f"or a function") from None
