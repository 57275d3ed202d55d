"""The built-in plans of ``tp_plan="auto"``, per stage class (Note [tensor-parallel plans]
in plans.py): Llama-family Hugging Face stages and the demo ``GPTStage``.  Each returns
concrete module names; ``plans.check_plan`` then checks every entry's type and shape."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

from ..models.gpt import Block, Embedding, GPTStage, Head
from ..planning.hf import GPT2Stage, LlamaStage

__all__ = ["auto_plan", "llama_plan", "gpt_plan"]


def auto_plan(stage: nn.Module, tp: int, stage_index: int) -> dict:
    """The built-in plan of ``stage``'s class, with concrete module names."""
    if isinstance(stage, GPT2Stage):
        raise ValueError(
            f"stage {stage_index} is a GPT2Stage (Hugging Face GPT-2), which has no built-in tensor-parallel plan: "
            f"its attention and MLP use transformers' Conv1D (c_attn holds q, k and v in one transposed weight), "
            f"which ColwiseParallel/RowwiseParallel cannot shard (they take nn.Linear and nn.Embedding). Pass "
            f"tp_plan as a dict for the modules they can shard, e.g. {{'transformer.wte': "
            f"RowwiseParallel(input_layouts=Replicate()), 'lm_head': ColwiseParallel(output_layouts=Replicate())}}, "
            f"or a function (stage_index, module, mesh) -> None that shards the Conv1D layers itself")
    if isinstance(stage, LlamaStage):
        return llama_plan(stage, tp, stage_index)
    if isinstance(stage, GPTStage):
        return gpt_plan(stage, tp, stage_index)
    kind = f"{type(stage).__module__}.{type(stage).__qualname__}"
    raise ValueError(
        f"stage {stage_index} is a {kind}, for which there is no built-in tensor-parallel plan (tp_plan='auto' knows "
        f"Llama-family stages of mpmd.split (Llama, Mistral, Qwen2, Qwen3) and mpmd.models.GPTStage); pass tp_plan "
        f"as a dict {{module name: ParallelStyle}}, e.g. {{'mlp.up': ColwiseParallel(), 'mlp.down': "
        f"RowwiseParallel()}}, or a function (stage_index, module, mesh) -> None")


def llama_plan(stage: LlamaStage, tp: int, stage_index: int) -> dict:
    """Attention q/k/v colwise (whole heads per actor), o rowwise; MLP gate/up colwise, down
    rowwise; the embedding vocabulary-parallel; the LM head colwise, its logits gathered."""
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
    for i in base.layers:
        at = f"model.layers.{i}"
        # Note [one input-gradient all-reduce per block]
        plan[f"{at}.self_attn"] = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                                     desired_input_kwarg_layouts={"hidden_states": Replicate()},
                                                     use_local_output=False)
        plan[f"{at}.mlp"] = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),),
                                               use_local_output=False)
        for proj in ("q_proj", "k_proj", "v_proj"):
            plan[f"{at}.self_attn.{proj}"] = ColwiseParallel()
        plan[f"{at}.self_attn.o_proj"] = RowwiseParallel()
        attn = base.layers[i].self_attn
        for norm in ("q_norm", "k_norm"):  # Qwen3: Note [per-head norms]
            if hasattr(attn, norm):
                plan[f"{at}.self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan[f"{at}.mlp.gate_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.up_proj"] = ColwiseParallel()
        plan[f"{at}.mlp.down_proj"] = RowwiseParallel()
    if hasattr(stage, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    _check_present(stage, plan, stage_index)
    return plan


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


def gpt_plan(stage: GPTStage, tp: int, stage_index: int) -> dict:
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
            plan[f"{i}.out"] = ColwiseParallel(output_layouts=Replicate())
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
