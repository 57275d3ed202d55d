"""The actors' side of Hugging Face safetensors: each actor writes its part of an export and
reads only its part of a pretrained model (Note [export from the actors] and Note [weights
from safetensors] in mpmd/training/export.py)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from .file_checks import plain_name, regular_stat
from .pieces import box_slices, local_box
from .tensor_parallel import local, whole

__all__ = ["write_safetensors", "read_safetensors", "expert_slices"]


def expert_slices(modules: dict, names: dict, boxes: dict) -> dict:
    """``{stage: {name: (offset, whole shape, Ray reference to this actor's experts)}}`` for the
    expert tensors of ``names`` (stage -> its keys) this actor holds: put into Ray's object
    store for the actor that writes them whole (Note [export from the actors])."""
    import ray

    out: dict = {}
    for s in sorted(names):
        state, stage_boxes = modules[int(s)].state_dict(), boxes[int(s)]
        for name in names[s]:
            if name in stage_boxes:
                b = stage_boxes[name]
                out.setdefault(s, {})[name] = (list(b.offset), list(b.whole), ray.put(state[name].detach().cpu()))
    return out


def _gathered(slices: list) -> torch.Tensor:
    """The whole tensor from its EP ranks' ``(offset, whole shape, reference)``, fetched one at a time."""
    import ray

    out = None
    for offset, shape, ref in slices:
        piece = ray.get(ref)
        if out is None:
            out = torch.empty(shape, dtype=piece.dtype)
        out[box_slices(offset, list(piece.shape))] = piece
    return out


def write_safetensors(path: str, modules: dict, names: dict, tp_rank: int, tp: int,
                      dtype: Optional[torch.dtype] = None, experts: Optional[dict] = None) -> dict:
    """Write this actor's part of a Hugging Face export to the safetensors file ``path``
    (Note [export from the actors] in mpmd/training/export.py): ``names`` maps stage -> {its
    key: the exported key}; each tensor is taken whole (a DTensor gathered over the TP group,
    one at a time, every TP rank in the same order; an expert tensor from its EP ranks'
    ``experts[stage][name]``, ``expert_slices``' references) and TP rank ``i % tp`` keeps the
    ``i``-th, cast to ``dtype``.  ``{exported key: bytes}`` of what this actor wrote."""
    from safetensors.torch import save_file

    kept, i, experts = {}, 0, experts or {}
    for s in sorted(names):
        state = modules[int(s)].state_dict()
        for name, key in names[s].items():
            slices = experts.get(s, {}).get(name)
            value = _gathered(slices) if slices else whole(state[name]).detach()
            if i % tp == tp_rank:
                value = value.to("cpu", dtype=dtype or value.dtype, copy=True).contiguous()
                kept[key] = value
            i += 1
    save_file(kept, path, metadata={"format": "pt"})
    return {k: v.numel() * v.element_size() for k, v in kept.items()}


def read_safetensors(directory: str, modules: dict, names: dict, weight_map: dict) -> None:
    """Copy into this actor's stages their tensors from the safetensors files in ``directory``:
    ``names`` maps stage -> {its key: the file's key, or None for a key the stage ties to
    another of its keys}; ``weight_map`` file key -> file.  A DTensor reads only its own box of
    the file's tensor (``get_slice``), a plain tensor the whole."""
    from safetensors import safe_open

    opened: dict = {}

    def file_of(key: str):
        name = weight_map[key]
        if name not in opened:  # checked here too: this node's files (Note [names from files])
            fix = "give a model directory whose weight map names its own .safetensors files"
            where = f"the weight map of {directory}: {key!r}"
            path = os.path.join(directory, plain_name(name, ".safetensors", where=where, fix=fix))
            if regular_stat(path, where=where, fix=fix) is None:
                raise ValueError(f"{where} is in {name}, which {directory} lacks on this node; {fix}")
            opened[name] = safe_open(path, framework="pt", device="cpu")
        return opened[name]

    for s in sorted(names):
        state = modules[int(s)].state_dict(keep_vars=True)
        loaded = set()
        for name, key in names[s].items():
            if key is None:
                continue
            target, source = state[name], file_of(key).get_slice(key)
            shape = tuple(source.get_shape())
            if shape != tuple(target.shape):
                raise ValueError(f"{key!r} in {weight_map[key]} has shape {shape}, but stage {s}'s {name!r} has "
                                 f"shape {tuple(target.shape)}: the files are of another model")
            if isinstance(target, DTensor):
                value = source[box_slices(*local_box(target))]
            else:
                value = file_of(key).get_tensor(key)
            with torch.no_grad():
                local(target).copy_(value)
            loaded.add(id(target))
        unfilled = [name for name, key in names[s].items() if key is None and id(state[name]) not in loaded]
        if unfilled:
            raise ValueError(f"the safetensors files in {directory} have no tensor for stage {s}'s {unfilled[:5]}")
