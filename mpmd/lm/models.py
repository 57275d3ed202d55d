"""The model of ``mpmd train``: a Llama (transformers' ``LlamaForCausalLM``, cut by
``mpmd.split``), a mixture of experts (``Qwen3MoeForCausalLM`` / ``DeepseekV3ForCausalLM``
from ``moe_models.py``, cut the same way) or the demo GPT, as one zero-argument factory per stage, so the actors
build the weights and the controller holds only the structure (Note [stage factories]).

Note [stage init]: a Llama stage's factory builds the whole model on the meta device (no
memory), takes its stage from ``split_causal_lm`` with the layer counts fixed on the
controller, materialises only that stage (``to_empty``) and initialises it with the
model's own ``_init_weights`` (a MoE model's experts, routers and router biases too) under the pipeline's seed contract; the rotary embedding's
buffers are recomputed.  Called under ``torch.device("meta")`` (the controller learning the
structure) it returns the stage still on meta.  With ``compile`` each decoder layer is
compiled in place (``nn.Module.compile``: regional compilation, keys unchanged)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from ..planning.memory import MoESpec
from .config import ModelConfig
from .moe_models import HF_CLASSES, MoEShape, moe_hf_config, moe_spec

__all__ = ["LlamaSpec", "llama_spec", "stage_factories", "meta_stages", "hf_config", "export_hf", "write_hf_metadata",
           "param_counts"]


@dataclasses.dataclass(frozen=True)
class LlamaSpec:
    """The resolved shape of the model (every size field set)."""

    family: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    rope_theta: float
    vocab_size: int
    rms_norm_eps: float
    initializer_range: float
    # the experts of a mixture-of-experts decoder (what the dry run's memory model counts: Note
    # [dry-run memory]); None: a dense MLP in every layer
    moe: Optional[MoESpec] = None
    # the rest of a MoE family's shape (model.family "qwen3_moe" or "deepseek_v3": moe_models.py)
    moe_shape: Optional[MoEShape] = None

    @property
    def head_dim(self) -> int:
        given = self.moe_shape.head_dim if self.moe_shape is not None else None
        return given or self.hidden_size // self.num_heads


def llama_spec(cfg: ModelConfig, vocab_size: int) -> LlamaSpec:
    keys = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size",
            "max_position_embeddings", "rope_theta")
    vocab = cfg.vocab_size if cfg.vocab_size is not None else vocab_size
    if vocab < vocab_size:
        raise ValueError(f"model.vocab_size ({vocab}) is smaller than the tokenizer's {vocab_size} tokens")
    moe, shape = moe_spec(cfg)
    return LlamaSpec(cfg.family, **{k: cfg.resolved(k) for k in keys}, vocab_size=vocab,
                     rms_norm_eps=cfg.rms_norm_eps, initializer_range=cfg.initializer_range, moe=moe, moe_shape=shape)


def hf_config(spec: LlamaSpec, eos_token_id: Optional[int] = None):
    import transformers

    if spec.moe_shape is not None:
        return moe_hf_config(spec, eos_token_id)
    return transformers.LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps, initializer_range=spec.initializer_range, tie_word_embeddings=False,
        eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None, attn_implementation="sdpa")


def _meta_llama(spec: LlamaSpec):
    import transformers

    with torch.device("meta"):
        return getattr(transformers, HF_CLASSES[spec.family])(hf_config(spec))


@dataclasses.dataclass(frozen=True)
class LlamaStageFactory:
    """Stage ``index`` of the Llama ``spec`` cut with ``counts`` decoder layers per stage
    (Note [stage init])."""

    spec: LlamaSpec
    counts: tuple[int, ...]
    index: int
    compile: bool = False
    backend: str = "inductor"

    def __call__(self) -> nn.Module:
        from ..planning.hf import split_causal_lm

        on_meta = torch.empty(0).is_meta
        model = _meta_llama(self.spec)
        stages, _, _ = split_causal_lm(model, len(self.counts), list(self.counts), balancer=None)
        stage = stages[self.index]
        if on_meta:
            return stage
        stage.to_empty(device="cpu")
        with torch.no_grad():
            for module in stage.modules():
                _init(module, self.spec.initializer_range)
        rotary = _rotary(stage.model.rotary_emb, model.config)
        stage.model.rotary_emb = rotary
        return self._compiled(stage)

    def build_sharded(self, shard, device) -> nn.Module:
        """The stage with only this actor's shards, on ``device``, equal to the slices of
        ``self()`` (Note [sharded build] in actors/build.py)."""
        from actors.build import fill_like_whole

        with torch.device("meta"):
            stage = self()
        shard(stage)
        stage.to_empty(device=device)
        with torch.no_grad():
            for module in stage.modules():
                _init(module, self.spec.initializer_range, fill_like_whole)
        stage.model.rotary_emb = _rotary(stage.model.rotary_emb, hf_config(self.spec)).to(device)
        return self._compiled(stage)

    def _compiled(self, stage: nn.Module) -> nn.Module:
        if self.compile:
            for layer in stage.model.layers.values():
                layer.compile(backend=self.backend)
        return stage


@dataclasses.dataclass(frozen=True)
class GPTStageFactory:
    """Stage ``index`` of the demo GPT (``mpmd.models``) in ``num_stages``."""

    spec: LlamaSpec
    seq_len: int
    num_stages: int
    index: int
    compile: bool = False
    backend: str = "inductor"

    def __call__(self) -> nn.Module:
        from ..models import Block, GPTConfig, gpt_stages

        cfg = GPTConfig(vocab_size=self.spec.vocab_size, seq_len=self.seq_len, d_model=self.spec.hidden_size,
                        n_heads=self.spec.num_heads, n_layers=self.spec.num_layers)
        stage = gpt_stages(cfg, num_stages=self.num_stages)[self.index]
        if self.compile:
            for block in stage:
                if isinstance(block, Block):
                    block.compile(backend=self.backend)
        return stage


def layer_counts(num_layers: int, num_stages: int) -> list[int]:
    """Decoder layers per stage: equal shares (the layers cost the same; the embedding is a
    lookup), the remainder to the middle stages (the first and last hold the ends)."""
    base, extra = divmod(num_layers, num_stages)
    order = sorted(range(num_stages), key=lambda s: (s in (0, num_stages - 1), abs(s - (num_stages - 1) / 2)))
    plus = set(order[:extra])
    return [base + (s in plus) for s in range(num_stages)]


def stage_factories(spec: LlamaSpec, num_stages: int, seq_len: int, compile: bool = False,
                    backend: str = "inductor", counts: Optional[list] = None) -> list:
    """One factory per stage; ``counts``: decoder layers per stage (default: equal shares)."""
    if spec.family == "gpt":
        return [GPTStageFactory(spec, seq_len, num_stages, s, compile, backend) for s in range(num_stages)]
    counts = tuple(counts or layer_counts(spec.num_layers, num_stages))
    return [LlamaStageFactory(spec, counts, s, compile, backend) for s in range(num_stages)]


def meta_stages(factories: list) -> list[nn.Module]:
    """The stages' structure on the meta device (no memory)."""
    with torch.device("meta"):
        return [f() for f in factories]


def param_counts(stages: list[nn.Module]) -> list[int]:
    return [sum(p.numel() for p in s.parameters()) for s in stages]


def export_hf(spec: LlamaSpec, pipe, tokenizer, directory: str, eos_token_id: int) -> str:
    """The trained model as a Hugging Face directory (sharded safetensors written by the actors:
    Note [export from the actors] in mpmd/training/export.py; the config and the tokenizer
    written here); ``transformers.AutoModelForCausalLM.from_pretrained(directory)`` loads it.
    The controller holds no weights."""
    from ..training.export import export_safetensors

    if spec.family not in HF_CLASSES:
        raise ValueError(f"the Hugging Face export needs a Hugging Face model.family ({', '.join(HF_CLASSES)}), "
                         f"got {spec.family!r}")
    export_safetensors(pipe.engine, directory)
    write_hf_metadata(spec, tokenizer, directory, eos_token_id)
    return directory


def write_hf_metadata(spec: LlamaSpec, tokenizer, directory: str, eos_token_id: int) -> None:
    """``config.json`` and the tokenizer's files beside exported weights."""
    import transformers

    config = hf_config(spec, eos_token_id)
    config.architectures = [HF_CLASSES[spec.family]]
    config.save_pretrained(directory)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=tokenizer.id_to_token(
        eos_token_id))
    fast.save_pretrained(directory)


def _init(module: nn.Module, std: float, fill=None) -> None:
    """transformers' Llama initialisation: normal(0, std) matrices, zero biases, unit norms;
    for a mixture of experts also its ``_init_weights``' normal(0, std) experts (fused 3-D
    ``gate_up_proj``, ``down_proj``) and router weights, and a zero router bias (a buffer,
    which ``to_empty`` leaves unset).  ``fill(tensor, init)`` applies each (default: in
    place; a sharded build: ``fill_like_whole``)."""
    fill = fill or (lambda t, init: init(t))
    normal = lambda t: nn.init.normal_(t, mean=0.0, std=std)  # noqa: E731
    if isinstance(getattr(module, "gate_up_proj", None), nn.Parameter):  # the experts
        fill(module.gate_up_proj, normal)
        fill(module.down_proj, normal)
    elif hasattr(module, "top_k") and isinstance(getattr(module, "weight", None), nn.Parameter):  # a router
        fill(module.weight, normal)
        if getattr(module, "e_score_correction_bias", None) is not None:
            fill(module.e_score_correction_bias, nn.init.zeros_)
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        fill(module.weight, lambda t: nn.init.normal_(t, mean=0.0, std=std))
        if getattr(module, "bias", None) is not None:
            fill(module.bias, nn.init.zeros_)
    elif "RMSNorm" in type(module).__name__:
        fill(module.weight, nn.init.ones_)


def _rotary(meta_rotary: nn.Module, config) -> nn.Module:
    """A fresh rotary embedding on the CPU (its inv_freq computed there, not left on meta)."""
    with torch.device("cpu"):
        return type(meta_rotary)(config)
