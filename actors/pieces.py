"""A tensor-parallel stage's checkpoint written and read shard by shard.

Note [checkpoint pieces]
~~~~~~~~~~~~~~~~~~~~~~~~
Under TP each actor holds a shard of the stage's sharded tensors (parameters and the
optimizer's state shaped like them).  Gathering them whole to write a checkpoint would put
the whole stage on every TP rank's device and in its host memory (at 70B, pp=8, tp=8: about
38 GB of weights and 77 GB of AdamW state per GPU at the first save), and reading whole files
would put them in every actor again.  Instead:

* **Save**: each TP rank writes its own part of each file (TP rank 0 the stage's own name,
  ``stage-0003.pt``; TP rank ``t`` ``stage-0003.tp-000t.pt``; likewise ZeRO-1's optimizer
  shards).  A sharded DTensor goes in as its *piece*: this actor's local tensor and its offset
  in the whole tensor (``{"mpmd.pieces": [{"offset": [...], "tensor": local}], "shape":
  [whole shape]}``: plain containers, so ``torch.load(weights_only=True)`` reads it).
  Replicated values (a norm's weight, a step count) are written by TP rank 0 only; the other
  parts hold ``None`` there.  No collective runs and every TP rank writes at once.
* **Load**: an actor memory-maps every part of the files of its stages
  (``torch.load(mmap=True)``: nothing is read until touched), merges the parts' pieces by
  position in the state, and copies into each of its tensors the intersection of its own box
  (its DTensor's offset and local shape under the *new* layout, or the whole tensor where it
  holds it whole) with every piece.  Only the pages under those intersections are read, and
  each piece's pages leave the actor's resident set once copied (``release_pages``), so an
  actor reads about its shard and never holds a whole sharded tensor; a layout of any
  other tp (1 included), dp or zero reads the same files.  A box the pieces do not cover
  completely is an error naming the tensor.

A checkpoint written at tp=1 holds whole tensors, which load as before (sliced by
``distribute_tensor`` without communication), and a whole tensor is one piece covering it
all, so every mixture of the two loads at any tp."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
from typing import Any, Optional

import torch
from torch.distributed.tensor import DTensor

__all__ = ["PIECES", "is_pieces", "pieces_of", "to_pieces", "part_of", "merge_parts", "assemble", "like", "shape_of",
           "mark_mapped", "release_pages", "local_box", "box_slices"]

PIECES = "mpmd.pieces"
MAPPED = "mapped"  # set on a piece read memory-mapped: its pages are released once copied
_MADV_DONTNEED = 4


def mark_mapped(value: Any) -> Any:
    """``value`` (as ``torch.load(mmap=True)`` read it) with each piece marked as file-backed."""
    if is_pieces(value):
        return {**value, PIECES: [{**p, MAPPED: True} for p in value[PIECES]]}
    if isinstance(value, dict):
        return {k: mark_mapped(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(mark_mapped(v) for v in value)
    return value


def release_pages(t: torch.Tensor) -> None:
    """Drop the pages under ``t``, a tensor memory-mapped privately from a file and never
    written, from this process's resident set (``madvise(MADV_DONTNEED)``: touched again, they
    are read from the file again).  Only for such tensors: on anonymous memory it would zero
    them.  A no-op where the call is missing (not Linux)."""
    if not sys.platform.startswith("linux") or t.numel() == 0:
        return
    page = mmap.PAGESIZE
    start = t.data_ptr() // page * page
    end = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


def is_pieces(v: Any) -> bool:
    return isinstance(v, dict) and PIECES in v


def shape_of(v: Any) -> list:
    """The whole tensor's shape, for a tensor or its pieces."""
    return list(v["shape"]) if is_pieces(v) else list(getattr(v, "shape", ()))


def local_box(t: DTensor) -> tuple[list, list]:
    """``(offset, shape)`` of this actor's part of the DTensor ``t`` in the whole tensor."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return list(offset), list(shape)


def box_slices(offset: list, shape: list) -> tuple:
    """The index of the box at ``offset`` of size ``shape``."""
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def pieces_of(t: DTensor) -> dict:
    """``t``'s local tensor with its offset in the whole tensor (no communication)."""
    offset, _ = local_box(t)
    return {PIECES: [{"offset": list(offset), "tensor": t.to_local().detach()}], "shape": list(t.shape)}


def to_pieces(value: Any) -> Any:
    """``value`` (a state dict, nested) with each sharded DTensor as its pieces and each
    replicated one as its local (whole) tensor."""
    if isinstance(value, DTensor):
        if all(p.is_replicate() for p in value.placements):
            return value.to_local().detach()
        return pieces_of(value)
    if isinstance(value, dict):
        return {k: to_pieces(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(to_pieces(v) for v in value)
    return value


def part_of(value: Any) -> Any:
    """What TP rank > 0 writes of ``value``: its pieces; ``None`` for the tensors TP rank 0 writes."""
    if is_pieces(value):
        return value
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, dict):
        return {k: part_of(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(part_of(v) for v in value)
    return value


def merge_parts(main: Any, part: Any, where: str = "") -> Any:
    """``main`` (TP rank 0's part) with the pieces ``part`` (another TP rank's) holds at the same places."""
    if is_pieces(main):
        if not is_pieces(part) or list(part["shape"]) != list(main["shape"]):
            raise ValueError(f"the checkpoint's tensor- or expert-parallel parts differ at {where or 'the top'}")
        return {**main, PIECES: list(main[PIECES]) + list(part[PIECES])}
    if isinstance(main, dict) and isinstance(part, dict):
        return {k: merge_parts(v, part.get(k), f"{where}.{k}" if where else str(k)) for k, v in main.items()}
    if isinstance(main, (list, tuple)) and isinstance(part, (list, tuple)) and len(main) == len(part):
        return type(main)(merge_parts(m, p, f"{where}[{i}]") for i, (m, p) in enumerate(zip(main, part)))
    return main


def assemble(value: dict, offset: Optional[list] = None, shape: Optional[list] = None, name: str = "a tensor") -> torch.Tensor:
    """The box at ``offset`` of size ``shape`` (default: the whole tensor) cut from ``value``'s
    pieces: only the pieces' parts inside the box are read."""
    whole = list(value["shape"])
    offset = list(offset) if offset is not None else [0] * len(whole)
    shape = list(shape) if shape is not None else whole
    pieces = value[PIECES]
    out = torch.empty(shape, dtype=pieces[0]["tensor"].dtype)
    covered = 0
    for piece in pieces:
        t, at = piece["tensor"], piece["offset"]
        lo = [max(a, b) for a, b in zip(offset, at)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offset, shape, at, t.shape)]
        if any(lo_ >= hi_ for lo_, hi_ in zip(lo, hi)):
            continue
        out[tuple(slice(l - a, h - a) for l, h, a in zip(lo, hi, offset))] = \
            t[tuple(slice(l - b, h - b) for l, h, b in zip(lo, hi, at))]
        covered += math.prod(h - l for l, h in zip(lo, hi))
        if piece.get(MAPPED):
            release_pages(t)
    if covered != out.numel():
        raise ValueError(f"the checkpoint's pieces of {name} (shape {whole}) cover {covered} of the {out.numel()} "
                         f"elements this actor needs at offset {offset}: a tensor- or expert-parallel part file is missing")
    return out


def like(ref: Any, value: dict, name: str = "a tensor") -> torch.Tensor:
    """``value``'s pieces laid out as ``ref``: this actor's box of a DTensor ``ref``, else the whole tensor."""
    if isinstance(ref, DTensor):
        offset, shape = local_box(ref)
        local = assemble(value, offset, shape, name).to(ref.device)
        return DTensor.from_local(local, ref.device_mesh, ref.placements, run_check=False,
                                  shape=ref.shape, stride=ref.stride())
    return assemble(value, name=name)
