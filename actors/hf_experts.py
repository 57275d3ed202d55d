"""Mixture-of-experts weights in Hugging Face safetensors files: one fused 3-D tensor per block
or one tensor per expert.

Note [expert file layouts]
~~~~~~~~~~~~~~~~~~~~~~~~~~
transformers' MoE modules hold a block's experts fused: ``<block>.experts.gate_up_proj``
``[E, 2I, H]`` and ``<block>.experts.down_proj`` ``[E, H, I]``.  Files on the Hub (and what
``save_pretrained`` writes, reversing transformers' conversion at load) hold one tensor per
expert instead, under one of two namings:

* ``"proj"`` (Qwen2/3-MoE, DeepSeek-V2/3, ...): ``<block>.experts.<e>.gate_proj.weight``,
  ``up_proj.weight`` (each ``[I, H]``) and ``down_proj.weight`` (``[H, I]``);
* ``"mixtral"``: the block named ``block_sparse_moe`` instead of ``mlp``, and ``w1`` (gate),
  ``w3`` (up), ``w2`` (down).

transformers' conversion (``conversion_mapping.py``: ``MergeModulelist(dim=0)`` then
``Concatenate(dim=1)``) stacks each part over the experts and concatenates gate then up on
dimension 1: ``gate_up_proj[e] = cat(gate[e], up[e])``, ``down_proj[e] = down[e]``.
``expert_sources`` finds, for a fused key the files lack, the per-expert keys they hold
(``((gate keys), (up keys))`` or ``((down keys),)``, one key per expert); ``read_experts``
builds experts ``[first, first + count)`` of the fused tensor from them, so an actor holding a
slice of the experts (expert parallelism) reads only its own experts' tensors;
``split_experts`` cuts a fused tensor back into the per-expert tensors an export writes.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

import torch

__all__ = ["LAYOUTS", "ExpertSource", "expert_sources", "per_expert_keys", "read_experts", "split_experts",
           "fused_shape"]

# layout -> (the block's name in the files for a module named "mlp", per fused parameter its parts' names)
LAYOUTS = {
    "proj": ("mlp", {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}),
    "mixtral": ("block_sparse_moe", {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}),
}
_FUSED = re.compile(r"^(?P<before>.*)\.mlp\.experts\.(?P<param>gate_up_proj|down_proj)$")

# Per part (gate, up; or down), the file key of every expert, in expert order.
ExpertSource = tuple[tuple[str, ...], ...]


def _naming(key: str, layout: str) -> Optional[tuple[str, tuple[str, ...]]]:
    """``(prefix, part names)`` of the per-expert keys ``<prefix>.<e>.<part>.weight`` holding the
    fused parameter ``key`` in ``layout``; None when ``key`` is not a fused expert parameter of a
    block named ``mlp``."""
    found = _FUSED.match(key)
    if found is None:
        return None
    block, parts = LAYOUTS[layout]
    return f"{found['before']}.{block}.experts", parts[found["param"]]


def per_expert_keys(key: str, num_experts: int, layout: str) -> Optional[ExpertSource]:
    """The per-expert file keys that hold the fused parameter ``key`` in ``layout`` (None when
    ``key`` is not a fused expert parameter)."""
    naming = _naming(key, layout)
    if naming is None:
        return None
    prefix, parts = naming
    return tuple(tuple(f"{prefix}.{e}.{part}.weight" for e in range(num_experts)) for part in parts)


def expert_sources(key: str, weight_map: dict) -> Optional[ExpertSource]:
    """The per-expert keys of ``weight_map`` that hold the fused parameter ``key`` (Note [expert
    file layouts]): experts ``0, 1, ...`` as far as the files hold the first part; None when
    ``key`` is not a fused expert parameter or the files hold none of its experts; a
    ``ValueError`` naming what is missing when they hold some parts of an expert only."""
    for layout in LAYOUTS:
        naming = _naming(key, layout)
        if naming is None:
            return None
        prefix, parts = naming
        count = 0
        while f"{prefix}.{count}.{parts[0]}.weight" in weight_map:
            count += 1
        if count == 0:
            continue
        keys = per_expert_keys(key, count, layout)
        missing = [k for part in keys for k in part if k not in weight_map]
        if missing:
            raise ValueError(f"the files hold {key!r} as one tensor per expert but lack {missing[:3]} "
                             f"({len(missing)} of its experts' tensors); give the whole model's files")
        return keys
    return None


def fused_shape(source: ExpertSource, shape_of: Callable[[str], tuple]) -> tuple:
    """The fused tensor's shape from its per-expert tensors' shapes (``shape_of(key)``), or a
    ``ValueError`` when the experts' tensors differ in shape."""
    shapes = [[tuple(shape_of(k)) for k in part] for part in source]
    for part in shapes:
        if any(s != part[0] for s in part) or len(part[0]) != 2:
            raise ValueError(f"the per-expert tensors {source[0][0]!r}... are not all of one 2-D shape: "
                             f"{sorted(set(part))}")
    if any(part[0][1] != shapes[0][0][1] for part in shapes):
        raise ValueError(f"the per-expert parts of {source[0][0]!r} differ in width: {[p[0] for p in shapes]}")
    return (len(source[0]), sum(part[0][0] for part in shapes), shapes[0][0][1])


def read_experts(source: ExpertSource, get_tensor: Callable[[str], torch.Tensor], first: int,
                 count: int) -> torch.Tensor:
    """Experts ``[first, first + count)`` of the fused tensor held as ``source``: per expert its
    parts concatenated on dimension 0 (gate then up), stacked (``[count, rows, cols]``)."""
    return torch.stack([torch.cat([get_tensor(part[e]) for part in source], dim=0)
                        for e in range(first, first + count)])


def split_experts(fused: torch.Tensor, source: ExpertSource, first: int = 0) -> dict[str, torch.Tensor]:
    """``{per-expert key: tensor}`` for the experts ``fused`` holds (``fused[i]`` is expert
    ``first + i``): each expert's rows cut into ``len(source)`` equal parts (gate, up)."""
    out = {}
    for i in range(fused.shape[0]):
        for part, rows in zip(source, fused[i].chunk(len(source), dim=0), strict=True):
            out[part[first + i]] = rows.contiguous()
    return out

