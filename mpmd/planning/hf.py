"""Cutting a Hugging Face causal LM into pipeline stages that need no wrappers.

``mpmd.split(model, num_stages)`` lands here when ``model`` is a transformers model.
Each stage holds the model's own submodules under the model's own paths (Note [model
keys]) and computes, from ``(x, attention_mask=None, position_ids=None)``, what the
model's forward computes for its layers (Note [stage forward]).

transformers is an optional dependency: nothing here imports it at module level; the
stages import its masking helpers when they run.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from actors.cp_runtime import active_shard
from actors.vocab_loss import vocab_parallel_cross_entropy

from .hf_moe import check_moe_model, expert_file_layout

__all__ = ["causal_lm_loss", "next_token_loss", "next_token_targets", "split_causal_lm", "HF_CAUSAL_LMS",
           "CausalLMStage", "GPT2Stage", "LlamaStage", "IGNORE_INDEX"]

IGNORE_INDEX = -100

# The classes split_causal_lm cuts, each with the transformers module that defines it
# and how its model picks a layer's attention mask ("llama": all causal; "mistral": all
# sliding-window when config.sliding_window is set; "layer_types": config.layer_types[i]).
_FAMILIES = {
    "GPT2LMHeadModel": ("gpt2", "gpt2"),
    "LlamaForCausalLM": ("llama", "llama"),
    "MistralForCausalLM": ("mistral", "mistral"),
    "Qwen2ForCausalLM": ("qwen2", "layer_types"),
    "Qwen3ForCausalLM": ("qwen3", "layer_types"),
    # Mixtures of experts (Note [Hugging Face MoE] in hf_moe.py): whole MoE layers, run as transformers runs them.
    "Qwen3MoeForCausalLM": ("qwen3_moe", "mistral"),
    "MixtralForCausalLM": ("mixtral", "mistral"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "llama"),
}
HF_CAUSAL_LMS = tuple(_FAMILIES)

# Note [model keys]: a stage's module tree mirrors the model's paths (``model.layers`` is
# an nn.ModuleDict keyed by the original layer indices), so every stage's state_dict()
# keys are the model's own and the stages' keys together are exactly the model's.
# ``keeps_model_keys = True`` tells the runtime to merge stage state dicts without a
# stage prefix, so ``model.load_state_dict(pipe.state_dict())`` works.  The stages hold
# the model's submodules, not copies: a tied LM head stays one Parameter shared by the
# first and the last stage, as in the model.  The one copy is the rotary embedding: each
# Llama-family stage owns one (non-persistent buffers, so not in the state dict).
#
# Note [stage forward]: every stage rebuilds what its layers need, as the model's forward
# does with no cache (training): position_ids default to arange(seq)[None]; the 4-D mask
# comes from transformers.masking_utils (create_causal_mask, or
# create_sliding_window_causal_mask for sliding-window layers) with the model's config,
# so the configured attention implementation picks the mask format (eager: additive
# float; sdpa: boolean or None for plain causal); Llama-family stages compute the rotary
# (cos, sin) from their own rotary module.  The mask helpers use their ``inputs_embeds``
# argument only for its shape, dtype and device, which a stage's incoming hidden states
# share with the model's embeddings.


class CausalLMStage(nn.Module):
    """One pipeline stage of a Hugging Face causal LM (see ``split_causal_lm``).

    ``forward(x, attention_mask=None, position_ids=None)``: the first stage takes
    ``input_ids`` (long, (batch, seq)), later stages the previous stage's hidden states;
    the last returns logits (batch, seq, vocab), the others hidden states.
    """

    keeps_model_keys = True

    def __init__(self, config: Any, layer_indices: Sequence[int], is_first: bool, is_last: bool) -> None:
        super().__init__()
        self.config = config
        self.layer_indices = tuple(layer_indices)
        self.is_first, self.is_last = is_first, is_last

    @staticmethod
    def default_positions(hidden: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        if position_ids is not None:
            return position_ids
        return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)

    def extra_repr(self) -> str:
        parts = (["embeddings"] if self.is_first else []) + [f"layers {list(self.layer_indices)}"]
        return ", ".join(parts + (["norm and head"] if self.is_last else []))


class LlamaStage(CausalLMStage):
    """A stage of ``LlamaForCausalLM`` and the models laid out like it (Mistral, Qwen2,
    Qwen3, and the MoE Qwen3-MoE, Mixtral, DeepSeek-V3): ``model.embed_tokens`` (first),
    ``model.layers.<i>``, ``model.norm`` and ``lm_head`` (last), and its own copy of
    ``model.rotary_emb``."""

    # its attention goes through transformers' interface ("mpmd_cp": actors/cp_runtime.py); the
    # config's limits are checked before actors start (mpmd/runtime/cp.py)
    supports_context_parallel = True

    def __init__(self, model: nn.Module, layer_indices: Sequence[int], is_first: bool, is_last: bool,
                 layer_types: Sequence[str]) -> None:
        super().__init__(model.config, layer_indices, is_first, is_last)
        # How an export names the experts in its files (Note [expert file layouts] in actors/hf_experts.py).
        self.expert_file_layout = expert_file_layout(type(model).__qualname__)
        base = model.model
        self.model = nn.Module()
        if is_first:
            self.model.embed_tokens = base.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): base.layers[i] for i in self.layer_indices})
        if is_last:
            self.model.norm = base.norm
        # Its own inv_freq; the config stays the one object the layers share.
        self.model.rotary_emb = copy.deepcopy(base.rotary_emb, {id(self.config): self.config})
        if is_last:
            self.lm_head = model.lm_head
        self.layer_types = tuple(layer_types[i] for i in self.layer_indices)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        hidden = self.model.embed_tokens(x) if self.is_first else x
        if self.layer_indices:
            shard = active_shard()  # Note [context-parallel runtime] in actors/cp_runtime.py: positions of the shard
            if shard is not None and position_ids is None:
                position_ids = shard.position_ids(hidden.shape[1], hidden.device)
            position_ids = self.default_positions(hidden, position_ids)
            masks = _causal_masks(self.config, set(self.layer_types), hidden, attention_mask, position_ids)
            rotary = self.model.rotary_emb(hidden, position_ids=position_ids)
            for kind, layer in zip(self.layer_types, self.model.layers.values()):
                hidden = layer(hidden, attention_mask=masks[kind], position_embeddings=rotary,
                               position_ids=position_ids)
        if self.is_last:
            hidden = self.lm_head(self.model.norm(hidden))
        return hidden


class GPT2Stage(CausalLMStage):
    """A stage of ``GPT2LMHeadModel``: ``transformer.wte``, ``transformer.wpe`` and the
    embedding dropout (first), ``transformer.h.<i>``, ``transformer.ln_f`` and ``lm_head``
    (last)."""

    def __init__(self, model: nn.Module, layer_indices: Sequence[int], is_first: bool, is_last: bool) -> None:
        super().__init__(model.config, layer_indices, is_first, is_last)
        base = model.transformer
        self.transformer = nn.Module()
        if is_first:
            self.transformer.wte, self.transformer.wpe, self.transformer.drop = base.wte, base.wpe, base.drop
        self.transformer.h = nn.ModuleDict({str(i): base.h[i] for i in self.layer_indices})
        if is_last:
            self.transformer.ln_f = base.ln_f
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.is_first:
            embeds = self.transformer.wte(x)
            position_ids = self.default_positions(embeds, position_ids)
            hidden = self.transformer.drop(embeds + self.transformer.wpe(position_ids).to(embeds.device))
        else:
            hidden = x
        if self.layer_indices:
            position_ids = self.default_positions(hidden, position_ids)
            if attention_mask is not None and attention_mask.ndim < 4:
                attention_mask = attention_mask.view(hidden.shape[0], -1)
            mask = _causal_masks(self.config, {"full_attention"}, hidden, attention_mask,
                                 position_ids)["full_attention"]
            for block in self.transformer.h.values():
                hidden = block(hidden, None, mask, position_ids=position_ids)
        if self.is_last:
            hidden = self.lm_head(self.transformer.ln_f(hidden))
        return hidden


def _causal_masks(config: Any, kinds: set, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                  position_ids: torch.Tensor) -> dict:
    from transformers import masking_utils  # optional dependency; loaded only by these stages

    make = {"full_attention": masking_utils.create_causal_mask,
            "sliding_attention": masking_utils.create_sliding_window_causal_mask}
    return {kind: make[kind](config=config, inputs_embeds=hidden, attention_mask=attention_mask,
                             past_key_values=None, position_ids=position_ids) for kind in kinds}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token cross-entropy as transformers computes it for causal LMs: position ``t``
    predicts ``labels[t + 1]``, labels equal to ``ignore_index`` (-100) do not count, and
    the loss is the mean over the counted tokens (in float32).  Logits sharded over the
    vocabulary (a DTensor: ``Pipeline(loss_parallel=True)``) are reduced on their shards
    (Note [vocabulary-parallel loss] in mpmd/tensor_parallel/builtin.py)."""
    return next_token_loss(logits, next_token_targets(labels, ignore_index=ignore_index), ignore_index=ignore_index)


def next_token_targets(labels: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``labels`` shifted for next-token prediction: ``targets[..., t] = labels[..., t + 1]``, the
    last position ``ignore_index``.  Shifted on the whole sequence, before it is cut into context-
    parallel shards (whose boundaries a shift inside the loss would cross: docs/context.md)."""
    return nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """``causal_lm_loss`` for targets already shifted (``next_token_targets``): position ``t``
    predicts ``targets[t]``; the mean over the counted tokens, in float32, on the vocabulary's
    shards for sharded logits.  ``causal_lm_loss(logits, labels)`` is exactly
    ``next_token_loss(logits, next_token_targets(labels))``."""
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets, ignore_index=ignore_index)
    logits = logits.float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).to(logits.device),
                                       ignore_index=ignore_index)


# -- the split ------------------------------------------------------------------------------------------


Balancer = Callable[[Sequence[float], int], list[int]]


def split_causal_lm(model: nn.Module, num_stages: Optional[int], balance: Union[str, Sequence[int], None], *,
                    balancer: Balancer) -> tuple[list[CausalLMStage], list[int], str]:
    """Cut a Hugging Face causal LM (one of ``HF_CAUSAL_LMS``) into stages of whole
    decoder layers: the first stage also holds the embeddings, the last the final norm
    and the LM head.

    ``balance="params"`` (default): ``balancer(costs, num_stages)`` (the min-max
    ``mpmd.planning.partition``) over per-layer parameter counts, the embeddings counted
    with the first layer and the norm and head with the last (a tied head counts on both
    ends: each of those stages holds it).  ``balance=[n0, n1, ...]``: decoder layers per
    stage.  Returns ``(stages, layers per stage, how)``.
    """
    name, family = _family(model)
    layers = _decoder_layers(model, name, family)
    check_moe_model(model, name)
    n = len(layers)
    if balance is None or balance == "params":
        k = _num_stages(num_stages, n, name)
        costs = [float(_params(layer)) for layer in layers]
        ends = _end_modules(model, family)
        costs[0] += sum(_params(m) for m in ends[0])
        costs[-1] += sum(_params(m) for m in ends[1])
        counts = balancer(costs, k)
        how = "balance='params'"
    elif isinstance(balance, (list, tuple)):
        counts = _check_counts(balance, n, num_stages, name)
        how = f"balance={list(counts)}"
    else:
        raise ValueError(f"balance={balance!r} is not supported for a Hugging Face model; use balance='params' "
                         f"(parameter counts) or balance=[decoder layers per stage]")
    types = _layer_types(model.config, family, n)
    stages: list[CausalLMStage] = []
    at = 0
    for s, c in enumerate(counts):
        indices, first, last = range(at, at + c), s == 0, s == len(counts) - 1
        stages.append(GPT2Stage(model, indices, first, last) if family == "gpt2"
                      else LlamaStage(model, indices, first, last, types))
        at += c
    how += f" over the {n} decoder layers of {name} (the first stage adds the embeddings, the last the head)"
    return stages, list(counts), how


def _family(model: nn.Module) -> tuple[str, str]:
    cls = type(model)
    entry = _FAMILIES.get(cls.__qualname__)
    if entry is None or cls.__module__ != f"transformers.models.{entry[0]}.modeling_{entry[0]}":
        raise ValueError(
            f"mpmd.split cannot cut {cls.__module__}.{cls.__qualname__}: it splits these Hugging Face causal LMs: "
            f"{', '.join(HF_CAUSAL_LMS)}. For another model, write one nn.Module per stage (each taking the "
            f"previous stage's output) and pass them in order: mpmd.Pipeline([stage0, stage1, ...], ...)")
    return cls.__qualname__, entry[1]


def _decoder_layers(model: nn.Module, name: str, family: str) -> nn.ModuleList:
    layers = model.transformer.h if family == "gpt2" else model.model.layers
    if len(layers) != model.config.num_hidden_layers:
        extra = (" (layers past num_hidden_layers would be DeepSeek's multi-token-prediction layers, which "
                 "transformers does not run and mpmd.split does not train)" if family == "llama" and
                 name.startswith("Deepseek") else "")
        raise ValueError(f"{name} has {len(layers)} decoder layers but its config says num_hidden_layers="
                         f"{model.config.num_hidden_layers}; the model runs only the first "
                         f"{model.config.num_hidden_layers}{extra}. Make them agree before splitting")
    return layers


def _end_modules(model: nn.Module, family: str) -> tuple[list[nn.Module], list[nn.Module]]:
    if family == "gpt2":
        t = model.transformer
        return [t.wte, t.wpe], [t.ln_f, model.lm_head]
    return [model.model.embed_tokens], [model.model.norm, model.lm_head]


def _layer_types(config: Any, family: str, n: int) -> list[str]:
    if family == "layer_types":
        return list(config.layer_types)
    if family == "mistral" and config.sliding_window is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


def _num_stages(num_stages: Optional[int], n: int, name: str) -> int:
    if num_stages is None:
        raise ValueError(f"split needs num_stages for {name} (or balance=[decoder layers per stage])")
    if not isinstance(num_stages, int) or isinstance(num_stages, bool) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > n:
        raise ValueError(f"num_stages={num_stages} is more than the {n} decoder layers of {name} (each stage needs "
                         f"at least one decoder layer); use num_stages <= {n}")
    return num_stages


def _check_counts(balance: Sequence[int], n: int, num_stages: Optional[int], name: str) -> list[int]:
    counts = list(balance)
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(f"balance={counts!r}: give a positive number of decoder layers for every stage")
    if num_stages is not None and num_stages != len(counts):
        raise ValueError(f"num_stages={num_stages} but balance={counts} lists {len(counts)} stages; make them agree")
    if sum(counts) != n:
        raise ValueError(f"balance={counts} covers {sum(counts)} decoder layers but {name} has {n}; "
                         f"the counts must add up to {n}")
    return counts


def _params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
