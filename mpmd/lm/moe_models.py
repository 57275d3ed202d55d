"""The mixture-of-experts families of ``mpmd train``: the shape of a Qwen3-MoE or DeepSeek-V3
model (``MoESpec``, beside the ``LlamaSpec`` fields every family shares) and its Hugging Face
config, from which ``models.py`` builds ``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM``
on the meta device and cuts it into stages as it does a Llama (Note [stage init] there).

What a DeepSeek-V3 here is: transformers' ``DeepseekV3ForCausalLM`` - multi-head latent
attention, group-limited sigmoid routing with the ``e_score_correction_bias`` (moved by
``optim.moe_bias_update_rate``: the auxiliary-loss-free balancing), one shared expert, the
first ``dense_layers`` layers dense, the router in float32 (transformers computes its logits
in float32 whatever the autocast).  Not built: multi-token prediction (transformers' model
has no MTP layers) and YaRN's long-context rope scaling (plain RoPE at ``rope_theta``)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..planning import MoESpec
from .model_config import MOE_FAMILIES, ModelConfig

__all__ = ["MoEShape", "moe_spec", "moe_hf_config", "HF_CLASSES", "layer_is_moe"]

# model.family -> the transformers class mpmd train builds
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """What a MoE family's Hugging Face config needs beyond the experts' counts (which are the
    planner's ``mpmd.planning.MoESpec``, ``LlamaSpec.moe``): the router's options and the
    attention's shape (Qwen3's head width; DeepSeek-V3's groups and latent attention)."""

    norm_topk_prob: bool
    head_dim: Optional[int] = None  # qwen3_moe; None: hidden / heads
    expert_groups: Optional[int] = None  # deepseek_v3 from here on
    topk_groups: Optional[int] = None
    routed_scaling_factor: Optional[float] = None
    kv_lora_rank: Optional[int] = None
    q_lora_rank: Optional[int] = None
    qk_rope_head_dim: Optional[int] = None
    qk_nope_head_dim: Optional[int] = None
    v_head_dim: Optional[int] = None


def moe_spec(cfg: ModelConfig) -> tuple[Optional[MoESpec], Optional[MoEShape]]:
    """The resolved experts (the planner's ``MoESpec``) and family shape of ``cfg`` (None, None
    for the dense families).  DeepSeek's ``shared_experts`` are one MLP of that many widths: as
    many MLPs of the experts' width in parameters and activations."""
    if cfg.family not in MOE_FAMILIES:
        return None, None
    r = cfg.resolved
    experts = MoESpec(num_experts=r("num_experts"), top_k=r("experts_per_token"),
                      expert_intermediate_size=r("moe_intermediate_size"), num_shared_experts=r("shared_experts"),
                      first_dense_layers=r("dense_layers"))
    return experts, MoEShape(**{f.name: r(f.name) for f in dataclasses.fields(MoEShape)})


def layer_is_moe(moe: Optional[MoESpec], index: int) -> bool:
    """Whether decoder layer ``index`` has experts (the first ``first_dense_layers`` have a dense MLP)."""
    return moe is not None and moe.is_moe_layer(index)


def moe_hf_config(spec, eos_token_id: Optional[int] = None):
    """The transformers config of the MoE ``spec`` (a ``LlamaSpec`` whose ``moe`` and ``moe_shape`` are set):
    eager experts (each expert's matmuls in turn, as the reference in one process), the
    router's logits not returned (the auxiliary loss is mpmd's, per microbatch and stage:
    docs/moe.md)."""
    import transformers

    m, shape = spec.moe, spec.moe_shape
    common = dict(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": spec.rope_theta}, rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.initializer_range, tie_word_embeddings=False, eos_token_id=eos_token_id,
        bos_token_id=None, pad_token_id=None, moe_intermediate_size=m.expert_intermediate_size,
        num_experts_per_tok=m.top_k, norm_topk_prob=shape.norm_topk_prob, output_router_logits=False,
        attn_implementation="sdpa", experts_implementation="eager")
    if spec.family == "qwen3_moe":
        config = transformers.Qwen3MoeConfig(**common, num_experts=m.num_experts, router_aux_loss_coef=0.0,
                                             mlp_only_layers=list(range(m.first_dense_layers)), decoder_sparse_step=1,
                                             head_dim=spec.head_dim)
    else:
        config = transformers.DeepseekV3Config(
            **common, n_routed_experts=m.num_experts, n_shared_experts=m.num_shared_experts,
            first_k_dense_replace=m.first_dense_layers, n_group=shape.expert_groups, topk_group=shape.topk_groups,
            routed_scaling_factor=shape.routed_scaling_factor, kv_lora_rank=shape.kv_lora_rank,
            q_lora_rank=shape.q_lora_rank, qk_rope_head_dim=shape.qk_rope_head_dim,
            qk_nope_head_dim=shape.qk_nope_head_dim, v_head_dim=shape.v_head_dim, num_mtp_layers=0)
    return config
