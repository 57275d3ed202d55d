"""Mixture-of-experts Hugging Face models under ``mpmd.split``: what runs and what is refused.

Note [Hugging Face MoE]
~~~~~~~~~~~~~~~~~~~~~~~
``Qwen3MoeForCausalLM``, ``MixtralForCausalLM`` and ``DeepseekV3ForCausalLM`` are cut like the
dense families (whole decoder layers, the model's own keys, hf.py).  A stage runs each decoder
layer's own module, so whatever transformers' MoE block does inside a layer runs as it is: the
router (softmax top-k, normalised or not; DeepSeek's sigmoid scores with the
``e_score_correction_bias`` buffer, group-limited routing over ``n_group``/``topk_group`` and
``routed_scaling_factor``), the experts as fused 3-D parameters (``gate_up_proj [E, 2I, H]``,
``down_proj [E, H, I]``, the protocol of Note [the MoE protocol] in actors/experts.py, which is
what expert parallelism shards), DeepSeek's shared experts, its multi-head latent attention
(``q_lora_rank``/``kv_lora_rank``, interleaved rotary) and its first dense layers
(``first_k_dense_replace``: plain MLP layers).  DeepSeek's router keeps its weight and bias in
float32 and computes in float32 whatever the model's dtype (transformers keeps them so under
bf16, ``_keep_in_fp32_modules_strict``); the stages keep the model's dtypes as given.

Refused, with the reason:

* ``config.output_router_logits = True`` (Qwen3-MoE, Mixtral): the model's forward then adds
  one auxiliary load-balancing loss computed from every layer's router logits together, which
  couples all layers across the pipeline's stages (no stage sees them all, and a stage's forward
  returns only hidden states).  The runtime's auxiliary loss is the alternative: per microbatch
  and per MoE layer, ``coef * E * sum_e f_e * P_e``, trained as if added to the loss
  (``mpmd.Pipeline(..., moe_aux_loss_coef=...)``).  It is the Switch/Megatron per-layer form,
  not transformers' formula over the layers pooled.
* DeepSeek's multi-token-prediction (MTP) module: transformers builds no MTP layer (a Hub
  checkpoint's ``model.layers.61.*`` are skipped when loading, as transformers skips them), so
  MTP is not trained; a model that holds decoder layers past ``num_hidden_layers`` is refused.
* Float8 checkpoint files (DeepSeek-V3's Hub weights with ``weight_scale_inv`` block scales):
  ``load_safetensors`` refuses float8 tensors instead of casting them unscaled; dequantize to
  bf16 first.

Mixtral's ``router_jitter_noise`` (0 by default) draws noise from each actor's random state, so
a run with it is not bitwise a single process's.
"""

from __future__ import annotations

from typing import Optional

from torch import nn

__all__ = ["MOE_CAUSAL_LMS", "check_moe_model", "expert_file_layout"]

# Each MoE class with the per-expert names its Hub files use (Note [expert file layouts] in
# actors/hf_experts.py): "proj" = experts.{e}.gate_proj/up_proj/down_proj (Qwen2/3-MoE, DeepSeek),
# "mixtral" = block_sparse_moe.experts.{e}.w1/w3/w2.
_LAYOUTS = {"Qwen3MoeForCausalLM": "proj", "MixtralForCausalLM": "mixtral", "DeepseekV3ForCausalLM": "proj"}
MOE_CAUSAL_LMS = tuple(_LAYOUTS)

AUX_LOSS_ALTERNATIVE = ("set model.config.output_router_logits = False and use the runtime's auxiliary loss, "
                        "computed per microbatch and per MoE layer inside each stage: "
                        "mpmd.Pipeline(..., moe_aux_loss_coef=model.config.router_aux_loss_coef)")


def expert_file_layout(class_name: str) -> Optional[str]:
    """The per-expert naming an export of ``class_name`` writes (None: not a MoE model)."""
    return _LAYOUTS.get(class_name)


def check_moe_model(model: nn.Module, name: str) -> None:
    """Refuse what a split MoE model cannot train as it would in one process (Note [Hugging Face MoE])."""
    if name not in _LAYOUTS:
        return
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            f"mpmd.split cannot cut {name} with config.output_router_logits=True: the model's forward then adds "
            f"an auxiliary load-balancing loss computed from every layer's router logits together, which couples "
            f"all layers across pipeline stages (no stage sees them all); {AUX_LOSS_ALTERNATIVE}")
