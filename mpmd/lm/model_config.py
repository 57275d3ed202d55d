"""The ``[model]`` section of ``mpmd train``'s config and its named sizes: a Llama
(transformers' ``LlamaForCausalLM``), the demo GPT, or a mixture of experts shaped like
Qwen3-MoE (``Qwen3MoeForCausalLM``) or DeepSeek-V3 (``DeepseekV3ForCausalLM``), each built
from its Hugging Face config and cut by ``mpmd.split`` (docs/moe.md, "mpmd train with
experts")."""

from __future__ import annotations

import os
from typing import ClassVar, Optional

from ..runtime.limits import FloatRange, IntRange
from .limits import (MAX_HEADS, MAX_HIDDEN, MAX_INTERMEDIATE, MAX_LAYERS, MAX_POSITIONS, MAX_VOCAB, POSITIVE,
                     check_choice, check_values, config_section)

__all__ = ["ModelConfig", "MODEL_SIZES", "MOE_SIZES", "MOE_FAMILIES", "MOE_KEYS", "sizes_of"]

# Named sizes (Llama layout).  vocab_size None: the tokenizer's.  Shapes follow the public
# configs: 125m (GPT-3 Small widths), 1b (Llama-3.2-1B), 8b (Llama-3-8B).
MODEL_SIZES = {
    "debug": dict(hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=176,
                  max_position_embeddings=256, rope_theta=10000.0),
    "125m": dict(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=12, intermediate_size=2048,
                 max_position_embeddings=2048, rope_theta=10000.0),
    "1b": dict(hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, intermediate_size=8192,
               max_position_embeddings=8192, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
               max_position_embeddings=8192, rope_theta=500000.0),
}
MOE_FAMILIES = ("qwen3_moe", "deepseek_v3")
_FAMILIES = ("llama", "gpt") + MOE_FAMILIES

# The keys only a mixture of experts has (None for llama and gpt), and the shape of the
# attention: head_dim for Qwen3-MoE, multi-head latent attention's ranks for DeepSeek-V3.
MOE_KEYS = ("num_experts", "experts_per_token", "moe_intermediate_size", "shared_experts", "dense_layers",
            "norm_topk_prob")
_HEAD_DIM = dict(head_dim=None)
_MLA_KEYS = ("expert_groups", "topk_groups", "routed_scaling_factor", "kv_lora_rank", "q_lora_rank",
             "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")
_NO_MLA = dict.fromkeys(_MLA_KEYS)

# Named MoE sizes.  "debug" trains on 2 CPU cores in about a minute; the full sizes follow the
# public configs (Qwen/Qwen3-235B-A22B, deepseek-ai/DeepSeek-V3: 128 experts top-8 and 256
# experts top-8 + 1 shared, 3 dense layers first) and are for --dry-run on a cluster.
MOE_SIZES = {
    "qwen3_moe": {
        "debug": dict(MODEL_SIZES["debug"], num_experts=8, experts_per_token=2, moe_intermediate_size=32,
                      shared_experts=0, dense_layers=0, norm_topk_prob=True, **_HEAD_DIM, **_NO_MLA),
        "235b-a22b": dict(hidden_size=4096, num_layers=94, num_heads=64, num_kv_heads=4, intermediate_size=12288,
                          max_position_embeddings=40960, rope_theta=1e6, num_experts=128, experts_per_token=8,
                          moe_intermediate_size=1536, shared_experts=0, dense_layers=0, norm_topk_prob=True,
                          head_dim=128, **_NO_MLA),
    },
    "deepseek_v3": {
        "debug": dict(MODEL_SIZES["debug"], num_kv_heads=4, num_experts=8, experts_per_token=2,
                      moe_intermediate_size=32, shared_experts=1, dense_layers=1, norm_topk_prob=True, **_HEAD_DIM,
                      expert_groups=4, topk_groups=2, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                      qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16),
        "671b": dict(hidden_size=7168, num_layers=61, num_heads=128, num_kv_heads=128, intermediate_size=18432,
                     max_position_embeddings=4096, rope_theta=10000.0, num_experts=256, experts_per_token=8,
                     moe_intermediate_size=2048, shared_experts=1, dense_layers=3, norm_topk_prob=True, **_HEAD_DIM,
                     expert_groups=8, topk_groups=4, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536,
                     qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    },
}


def sizes_of(family: str) -> dict:
    """The named sizes of ``family``."""
    return MOE_SIZES.get(family, MODEL_SIZES)


_EXPERTS = IntRange(1, 65_536, "256x DeepSeek-V3's 256 routed experts", optional=True)
_RANK = IntRange(1, MAX_HIDDEN, "DeepSeek-V3's ranks are at most its hidden size (MAX_HIDDEN)", optional=True)


@config_section
class ModelConfig:
    """``family`` "llama" (transformers' LlamaForCausalLM, split by mpmd.split), "gpt" (the demo
    GPT), "qwen3_moe" (Qwen3MoeForCausalLM) or "deepseek_v3" (DeepseekV3ForCausalLM);
    ``size`` one of the family's named sizes (below), any field given here overriding it.  The
    mixture-of-experts keys (num_experts ... v_head_dim) are for the MoE families only."""

    family: str = "llama"  # "llama", "gpt", "qwen3_moe" or "deepseek_v3"
    size: str = "debug"  # one of the family's sizes (below)
    hidden_size: Optional[int] = None  # None: the size's
    num_layers: Optional[int] = None  # decoder layers; None: the size's
    num_heads: Optional[int] = None  # attention heads; None: the size's
    num_kv_heads: Optional[int] = None  # key/value heads (grouped-query attention); None: the size's
    intermediate_size: Optional[int] = None  # the MLP's width (a MoE model's dense layers); None: the size's
    max_position_embeddings: Optional[int] = None  # positions; data.seq_len must fit; None: the size's
    rope_theta: Optional[float] = None  # RoPE base; None: the size's
    vocab_size: Optional[int] = None  # None: the tokenizer's
    rms_norm_eps: float = 1e-5  # RMSNorm epsilon
    initializer_range: float = 0.02  # std of the normal initialisation
    # A safetensors model directory (save_pretrained's, or a run's export) to start from, each
    # actor reading its own part (Note [weights from safetensors]); a resumed run's checkpoint wins.
    init_from: Optional[str] = None  # a safetensors model directory to start from; a checkpoint wins
    head_dim: Optional[int] = None  # qwen3_moe: an attention head's width; None: the size's (else hidden / heads)
    num_experts: Optional[int] = None  # MoE: routed experts per MoE layer; None: the size's
    experts_per_token: Optional[int] = None  # MoE: top-k, the experts each token goes to; None: the size's
    moe_intermediate_size: Optional[int] = None  # MoE: an expert's MLP width; None: the size's
    shared_experts: Optional[int] = None  # deepseek_v3: shared experts (one MLP of that many widths); None: size's
    dense_layers: Optional[int] = None  # MoE: the first layers with a dense MLP, not experts; None: the size's
    norm_topk_prob: Optional[bool] = None  # MoE: the top-k weights renormalised to sum to 1; None: the size's
    expert_groups: Optional[int] = None  # deepseek_v3: groups of experts (group-limited routing); None: size's
    topk_groups: Optional[int] = None  # deepseek_v3: the groups a token's experts come from; None: the size's
    routed_scaling_factor: Optional[float] = None  # deepseek_v3: the routed experts' weight scale; None: size's
    kv_lora_rank: Optional[int] = None  # deepseek_v3: latent attention's key/value rank; None: the size's
    q_lora_rank: Optional[int] = None  # deepseek_v3: latent attention's query rank; None: the size's
    qk_rope_head_dim: Optional[int] = None  # deepseek_v3: a head's rotary part; None: the size's
    qk_nope_head_dim: Optional[int] = None  # deepseek_v3: a head's non-rotary query/key part; None: the size's
    v_head_dim: Optional[int] = None  # deepseek_v3: a head's value width; None: the size's

    LIMITS: ClassVar[dict] = dict(
        hidden_size=IntRange(1, MAX_HIDDEN, "4x Llama 3 405B's (MAX_HIDDEN)", optional=True),
        num_layers=IntRange(1, MAX_LAYERS, "8x Llama 3 405B's (MAX_LAYERS)", optional=True),
        num_heads=IntRange(1, MAX_HEADS, "8x Llama 3 405B's (MAX_HEADS)", optional=True),
        num_kv_heads=IntRange(1, MAX_HEADS, "8x Llama 3 405B's query heads (MAX_HEADS)", optional=True),
        intermediate_size=IntRange(1, MAX_INTERMEDIATE, "5x Llama 3 405B's (MAX_INTERMEDIATE)", optional=True),
        max_position_embeddings=IntRange(1, MAX_POSITIONS, "8x Llama 3.1's context (MAX_POSITIONS)", optional=True),
        vocab_size=IntRange(1, MAX_VOCAB, "8x the largest vocabularies in use (MAX_VOCAB)", optional=True),
        rope_theta=FloatRange(0.0, low_open=True, optional=True),
        rms_norm_eps=POSITIVE,
        initializer_range=POSITIVE,
        head_dim=_RANK,
        num_experts=_EXPERTS,
        experts_per_token=_EXPERTS,
        moe_intermediate_size=IntRange(1, MAX_INTERMEDIATE, "MAX_INTERMEDIATE", optional=True),
        shared_experts=IntRange(0, 64, "DeepSeek-V3 has 1, DeepSeek-V2 2", optional=True),
        dense_layers=IntRange(0, MAX_LAYERS, "the model's layers (MAX_LAYERS)", optional=True),
        expert_groups=_EXPERTS,
        topk_groups=_EXPERTS,
        routed_scaling_factor=FloatRange(0.0, low_open=True, optional=True),
        kv_lora_rank=_RANK,
        q_lora_rank=_RANK,
        qk_rope_head_dim=_RANK,
        qk_nope_head_dim=_RANK,
        v_head_dim=_RANK,
    )

    def __post_init__(self) -> None:
        check_values("model", self)
        check_choice("model", "family", self.family, _FAMILIES)
        if self.norm_topk_prob is not None and not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"model.norm_topk_prob must be true or false, got {self.norm_topk_prob!r}")
        if self.init_from is not None and not os.path.isdir(self.init_from):
            raise ValueError(f"model.init_from = {self.init_from!r} is not a directory; give a safetensors model "
                             f"directory (one save_pretrained or a run's export wrote)")
        check_choice("model", "size", self.size, tuple(sizes_of(self.family)))  # the family's sizes
        if self.resolved("hidden_size") % self.resolved("num_heads"):
            raise ValueError(f"model.hidden_size ({self.resolved('hidden_size')}) must be divisible by "
                             f"model.num_heads ({self.resolved('num_heads')})")
        if self.resolved("num_heads") % self.resolved("num_kv_heads"):
            raise ValueError(f"model.num_heads ({self.resolved('num_heads')}) must be divisible by "
                             f"model.num_kv_heads ({self.resolved('num_kv_heads')})")
        self._check_moe()

    def _check_moe(self) -> None:
        own = MOE_KEYS + (("head_dim",) if self.family == "qwen3_moe" else _MLA_KEYS)
        given = [k for k in MOE_KEYS + ("head_dim",) + _MLA_KEYS if getattr(self, k) is not None and k not in own]
        if self.family not in MOE_FAMILIES:
            given += [k for k in own if getattr(self, k) is not None]
        if given:
            raise ValueError(f"model.{given[0]} is not a key of model.family = {self.family!r}: the mixture-of-experts "
                             f"keys are for \"qwen3_moe\" and \"deepseek_v3\" (head_dim: qwen3_moe; the latent "
                             f"attention's ranks and the expert groups: deepseek_v3); remove it or change the family")
        if self.family not in MOE_FAMILIES:
            return
        experts, top_k = self.resolved("num_experts"), self.resolved("experts_per_token")
        if top_k > experts:
            raise ValueError(f"model.experts_per_token ({top_k}) is more than model.num_experts ({experts}): a token "
                             f"goes to top-k distinct experts; lower experts_per_token or add experts")
        if self.resolved("dense_layers") >= self.resolved("num_layers"):
            raise ValueError(f"model.dense_layers ({self.resolved('dense_layers')}) leaves none of the "
                             f"{self.resolved('num_layers')} layers (model.num_layers) with experts; lower it")
        if self.family == "qwen3_moe" and self.resolved("shared_experts"):
            raise ValueError("model.shared_experts: Qwen3-MoE has no shared experts; set it to 0 or use "
                             "family = \"deepseek_v3\"")
        if self.family == "deepseek_v3":
            groups, topk_groups = self.resolved("expert_groups"), self.resolved("topk_groups")
            if experts % groups or topk_groups > groups or top_k > topk_groups * (experts // groups):
                raise ValueError(f"model.expert_groups ({groups}) must divide model.num_experts ({experts}), and "
                                 f"topk_groups ({topk_groups}) groups of {experts // max(1, groups)} experts must "
                                 f"hold experts_per_token ({top_k}) and be at most expert_groups")
            if experts // groups < 2:
                raise ValueError(f"model.expert_groups ({groups}): each group needs 2 experts at least (a group's "
                                 f"score is its best two); use at most {experts // 2} groups")

    def resolved(self, key: str):
        """A shape field: the value given, else the named size's (None: the family has no such key)."""
        value = getattr(self, key)
        return sizes_of(self.family)[self.size].get(key) if value is None else value
