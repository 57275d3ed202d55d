"""The actors' side of Hugging Face safetensors: each actor writes its part of an export and
reads only its part of a pretrained model (Note [export from the actors] and Note [weights
from safetensors] in mpmd/training/export.py)."""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

from .file_checks import plain_name, regular_stat
from .hf_experts import fused_shape, read_experts, split_experts
from .pieces import box_slices, local_box
from .tensor_parallel import local, whole

__all__ = ["write_safetensors", "read_safetensors"]


def write_safetensors(path: str, modules: dict, names: dict, tp_rank: int, tp: int,
                      dtype: Optional[torch.dtype] = None) -> dict:
    """Write this actor's part of a Hugging Face export to the safetensors file ``path``
    (Note [export from the actors] in mpmd/training/export.py): ``names`` maps stage -> {its
    key: the exported key, or a fused expert parameter's per-expert keys (Note [expert file
    layouts])}; each tensor is taken whole (a DTensor gathered over the TP group,
    one at a time, every TP rank in the same order) and TP rank ``i % tp`` keeps the ``i``-th,
    cast to ``dtype``.  ``{exported key: bytes}`` of what this actor wrote."""
    from safetensors.torch import save_file

    kept, i = {}, 0
    for s in sorted(names):
        state = modules[int(s)].state_dict()
        experts = _expert_ranges(modules[int(s)])
        for name, key in names[s].items():
            value = whole(state[name]).detach()
            if i % tp == tp_rank:
                value = value.to("cpu", dtype=dtype or value.dtype, copy=True).contiguous()
                if isinstance(key, tuple):  # one tensor per expert (Note [expert file layouts])
                    kept.update(split_experts(value, key, experts.get(name, (0,))[0]))
                else:
                    kept[key] = value
            i += 1
    save_file(kept, path, metadata={"format": "pt"})
    return {k: v.numel() * v.element_size() for k, v in kept.items()}


def read_safetensors(directory: str, modules: dict, names: dict, weight_map: dict) -> None:
    """Copy into this actor's stages their tensors from the safetensors files in ``directory``:
    ``names`` maps stage -> {its key: the file's key, a fused expert parameter's per-expert keys
    (Note [expert file layouts]), or None for a key the stage ties to another of its keys}; ``weight_map`` file key -> file.  A DTensor reads only its own box of
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

    def tensor(key: str) -> torch.Tensor:
        return file_of(key).get_tensor(key)

    for s in sorted(names):
        module = modules[int(s)]
        state = module.state_dict(keep_vars=True)
        experts = _expert_ranges(module)
        loaded = set()
        for name, key in names[s].items():
            if key is None:
                continue
            target = state[name]
            if isinstance(key, tuple):  # one tensor per expert (Note [expert file layouts])
                shape = fused_shape(key, lambda k: file_of(k).get_slice(k).get_shape())
            else:
                source = file_of(key).get_slice(key)
                shape = tuple(source.get_shape())
            first, rows = experts.get(name, (0, None))  # a slice of the experts: rows [first, first + local)
            whole = tuple(target.shape) if rows is None else (rows, *target.shape[1:])
            if shape != whole:
                where = f"{key[0][0]!r} and the other experts' tensors" if isinstance(key, tuple) else repr(key)
                raise ValueError(f"{where} in {weight_map[key[0][0] if isinstance(key, tuple) else key]} "
                                 f"{'make' if isinstance(key, tuple) else 'has'} shape {shape}, but stage {s}'s "
                                 f"{name!r} has shape {whole}: the files are of another model")
            count = target.shape[0] if rows is not None or isinstance(key, tuple) else None
            if isinstance(key, tuple):
                value = read_experts(key, tensor, first, count)
            elif isinstance(target, DTensor):
                value = source[box_slices(*local_box(target))]
            elif rows is not None:  # this actor's experts of the whole tensor (expert parallelism)
                value = source[first:first + count]
            else:
                value = tensor(key)
            with torch.no_grad():
                local(target).copy_(value)
            loaded.add(id(target))
        unfilled = [name for name, key in names[s].items() if key is None and id(state[name]) not in loaded]
        if unfilled:
            raise ValueError(f"the safetensors files in {directory} have no tensor for stage {s}'s {unfilled[:5]}")


def _expert_ranges(module: torch.nn.Module) -> dict:
    """Parameter name -> (first expert, whole expert count) for the experts sharded over expert
    parallelism in ``module`` (``expert_ranges`` of actors/experts.py)."""
    try:
        from .experts import expert_ranges
    except ImportError:  # the expert-parallel core is not on this branch yet
        return {}
    return expert_ranges(module)
