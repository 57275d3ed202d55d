"""A Hugging Face causal LM given on the meta device: split into stage factories, so the model
never exists whole anywhere.

Note [meta-built stages]
~~~~~~~~~~~~~~~~~~~~~~~~
At DeepSeek-V3 or Qwen3-235B sizes nobody can build the model on the controller.  Given a model
whose parameters are on the meta device (``with torch.device("meta"): Cls(config)``, no
memory), ``mpmd.split`` cuts it as usual (the same layer counts, the same keys) but returns one
``MetaStageFactory`` per stage instead of modules (Note [stage factories] in actors/build.py).
Each actor holding stage ``s`` calls its factory: the model is built again on the meta device,
cut with the counts fixed on the controller, and only stage ``s`` is materialised on the actor
(``to_empty``) and initialised with the model's own ``_init_weights`` under the pipeline's seed
contract; the rotary embedding's buffers are recomputed.  Under TP, ``build_sharded`` gives the
actor only its shards (Note [sharded build]).  Under EP the stage's experts are built and then
cut to the actor's experts (``shard_experts``), so an actor's peak is its stage, never the model.
The weights then come from a safetensors directory: ``pipe.load_safetensors(directory)``, each
actor reading only its own tensors (its experts' rows or per-expert tensors under EP: Note
[weights from safetensors] in mpmd/training/export.py) - a ``save_pretrained`` directory, the
Hub's files or an export.

A tied head (``tie_word_embeddings``) would be one parameter shared by the first and the last
stage, which separate factory calls cannot share: refused, with the fix.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Optional, Sequence

import torch
from torch import nn

__all__ = ["MetaStageFactory", "is_on_meta", "meta_factories"]


def is_on_meta(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are on the meta device (all of them: a half-built model is refused)."""
    devices = {p.is_meta for p in model.parameters()}
    if devices == {True, False}:
        raise ValueError("the model has parameters on the meta device and others not; build it wholly on meta "
                         "(with torch.device('meta'): Model(config)) for a split that builds each stage on its "
                         "actors, or wholly materialised")
    return devices == {True}


@dataclasses.dataclass(frozen=True)
class MetaStageFactory:
    """Stage ``index`` of the Hugging Face model ``module.qualname`` built from ``config``, cut
    with ``counts`` decoder layers per stage (Note [meta-built stages])."""

    module: str
    qualname: str
    config: Any = dataclasses.field(repr=False)
    counts: tuple[int, ...]
    index: int

    def _meta_stage(self):
        from .hf import split_causal_lm

        cls = getattr(importlib.import_module(self.module), self.qualname)
        with torch.device("meta"):
            model = cls(self.config)
        stages, _, _ = split_causal_lm(model, len(self.counts), list(self.counts), balancer=None)
        return model, stages[self.index]

    def __call__(self) -> nn.Module:
        on_meta = torch.empty(0).is_meta  # the controller learning the structure
        model, stage = self._meta_stage()
        if on_meta:
            return stage
        stage.to_empty(device="cpu")
        self._initialise(model, stage, fill=None)
        return stage

    def build_sharded(self, shard, device) -> nn.Module:
        """The stage with only this actor's TP shards, on ``device`` (Note [sharded build] in
        actors/build.py)."""
        from actors.build import fill_like_whole

        model, stage = self._meta_stage()
        shard(stage)
        stage.to_empty(device=device)
        self._initialise(model, stage, fill=fill_like_whole)
        return stage

    def _initialise(self, model: nn.Module, stage: nn.Module, fill: Optional[Any]) -> None:
        """Every tensor of the stage as transformers initialises them (``_initialise``; ``fill``:
        ``fill_like_whole`` for a TP shard), the rotary embedding rebuilt off the meta device."""
        device = next((t.device for t in stage.parameters()), torch.device("cpu"))
        std = getattr(self.config, "initializer_range", 0.02)
        with torch.no_grad():
            for module in stage.modules():
                _initialise(module, std, fill or (lambda t, init: init(t)))
        rotary = stage.model.rotary_emb
        with torch.device("cpu"):
            stage.model.rotary_emb = type(rotary)(self.config).to(device)


def _initialise(module: nn.Module, std: float, fill) -> None:
    """transformers' initialisation, tensor by tensor: normal(0, ``std``) weights (matrices,
    embeddings, fused experts, routers), zero biases and buffers (DeepSeek's router bias), unit
    norm weights; ``fill(tensor, init)`` applies each.  Placeholders until weights are loaded."""
    norm = "Norm" in type(module).__name__
    for name, p in module.named_parameters(recurse=False):
        if name == "bias":
            fill(p, nn.init.zeros_)
        elif norm:
            fill(p, nn.init.ones_)
        else:
            fill(p, lambda t: nn.init.normal_(t, mean=0.0, std=std))
    if "Rotary" not in type(module).__name__:
        for b in module.buffers(recurse=False):
            b.zero_()


def meta_factories(model: nn.Module, counts: Sequence[int]) -> list[MetaStageFactory]:
    """One factory per stage of ``model`` (on the meta device) cut with ``counts`` (Note
    [meta-built stages]); a tied head refused."""
    if getattr(model.config, "tie_word_embeddings", False):
        raise ValueError(f"{type(model).__qualname__} on the meta device has a tied head (config.tie_word_embeddings"
                         f"=True): the first and the last stage would share one parameter, which stages built on "
                         f"their actors cannot; build the model with tie_word_embeddings=False (the files' "
                         f"embedding then also fills lm_head.weight when it lacks one), or materialise it")
    cls = type(model)
    return [MetaStageFactory(cls.__module__, cls.__qualname__, model.config, tuple(counts), s)
            for s in range(len(counts))]
