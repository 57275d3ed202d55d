"""Values passed between stages: a tensor, or a tuple/list/dict of tensors (nested).

A value is flattened into its tensors plus a small structure ``spec`` so it can
travel as a few point-to-point messages and be rebuilt on the other side.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, NamedTuple, Optional

import msgpack
import numpy as np
import torch

__all__ = ["flatten", "unflatten", "TensorMeta", "meta_of", "encode_header", "decode_header", "HEADER_BYTES",
           "payload_bytes", "PackedBatch", "pack_batch", "unpack_batch", "to_device", "describe", "describe_metas"]

# A header announces the structure, shapes and dtypes of the next value on a channel.
HEADER_BYTES = 4096

TensorMeta = tuple  # (shape tuple, dtype name)


# Note [no cycles around tensors]: ``flatten`` and ``unflatten`` walk with module-level
# functions, not nested recursive closures.  A closure that calls itself holds its own cell, a
# reference cycle that keeps its frame's variables (the list of tensors, the iterator over
# them) alive until Python's cyclic collector happens to run.  For a last stage's output that
# is the logits and, until its backward, their whole autograd graph: measured on a 125M-shaped
# Llama under 1F1B, the last actor kept one to three earlier microbatches' logits (32 MiB
# each) past their FREE, and its peak rose by 64-100 MiB above what the memory model predicts.


def flatten(value: Any, where: str = "stage output") -> tuple[Any, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []
    return _walk(value, tensors, where), tensors


def _walk(v: Any, tensors: list, where: str) -> Any:
    if isinstance(v, torch.Tensor):
        tensors.append(v)
        return "T"
    if isinstance(v, (tuple, list)):
        return ["L" if isinstance(v, list) else "U", [_walk(x, tensors, where) for x in v]]
    if isinstance(v, dict):
        if not all(isinstance(k, str) for k in v):
            raise TypeError(f"{where}: dict values between stages need str keys, got {list(v)!r}")
        return ["D", [[k, _walk(x, tensors, where)] for k, x in v.items()]]
    raise TypeError(
        f"{where} is a {type(v).__name__}; values passed between stages must be a tensor "
        "or a tuple/list/dict of tensors"
    )


def unflatten(spec: Any, tensors: list[torch.Tensor]) -> Any:
    return _build(spec, iter(tensors))


def _build(s: Any, it) -> Any:
    if s == "T":
        return next(it)
    tag, items = s
    if tag == "D":
        return {k: _build(x, it) for k, x in items}
    seq = [_build(x, it) for x in items]
    return seq if tag == "L" else tuple(seq)


def meta_of(tensors: list[torch.Tensor]) -> list[TensorMeta]:
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]


def describe(value: Any) -> str:
    """``(2, 8) float32, (2,) int64``: the shapes and dtypes of a value's tensors."""
    try:
        _, tensors = flatten(value, where="input")
    except TypeError:
        return type(value).__name__
    return describe_metas(meta_of(tensors))


def describe_metas(metas: list[TensorMeta]) -> str:
    return ", ".join(f"{tuple(shape)} {dtype}" for shape, dtype in metas)


def to_device(value: Any, device: torch.device) -> Any:
    """The value with every tensor on ``device``; host tensors go to a GPU from pinned memory
    without blocking this thread (the copy is ordered on the stream before its first use)."""
    spec, tensors = flatten(value, where="input")
    if device.type == "cuda":
        return unflatten(spec, [t.pin_memory().to(device, non_blocking=True) if t.device.type == "cpu" else
                                t.to(device) for t in tensors])
    return unflatten(spec, [t.to(device) for t in tensors])


def dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def encode_header(spec: Any, metas: list[TensorMeta]) -> torch.Tensor:
    raw = msgpack.packb([spec, [[list(s), d] for s, d in metas]])
    if len(raw) + 4 > HEADER_BYTES:
        raise ValueError(f"value structure too large to announce ({len(raw)} bytes); pass fewer, larger tensors")
    buf = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    buf[:4] = torch.tensor(list(len(raw).to_bytes(4, "little")), dtype=torch.uint8)
    buf[4 : 4 + len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return buf


def decode_header(buf: torch.Tensor) -> tuple[Any, list[TensorMeta]]:
    data = bytes(buf.tolist())
    n = int.from_bytes(data[:4], "little")
    spec, metas = msgpack.unpackb(data[4 : 4 + n])
    return spec, [(tuple(s), d) for s, d in metas]


class PackedBatch(NamedTuple):
    """Microbatches on their way from the controller to an actor.

    Each tensor of the microbatch structure travels once, stacked over the microbatches,
    as a numpy array: Ray serializes numpy arrays out of band, while a torch tensor
    pickles through ``torch.save``, and each extra buffer costs tens of microseconds of
    dispatch (docs/profiling.md).
    """

    spec: Any  # the structure of one microbatch value
    count: int  # microbatches
    arrays: list  # per tensor: the microbatches stacked (numpy where numpy can hold the dtype)


def pack_batch(values: Optional[list]) -> Any:
    """A list of microbatch values ready for the RPC; ragged ones go as they are."""
    if values is None:
        return None
    flat = [flatten(v, where="inputs") for v in values]
    spec = flat[0][0] if flat else None
    leaves = list(zip(*(tensors for _, tensors in flat)))
    if (not flat or any(sp != spec for sp, _ in flat)
            or any(len({(t.shape, t.dtype, t.device) for t in leaf}) > 1 for leaf in leaves)):
        return values
    return PackedBatch(spec, len(values), [_numpy_or_tensor(torch.stack(leaf)) for leaf in leaves])


# A small packed batch travels as one pickled bytes object: Ray hands bytes over with
# far less work than numpy arguments (~0.25 ms less per RPC here).  Large ones stay
# arrays, which Ray moves out of band without copies.
INLINE_BYTES = 1 << 20


def to_rpc(packed: Any) -> Any:
    """``pack_batch``'s result as it goes into the RPC."""
    if (isinstance(packed, PackedBatch) and all(isinstance(a, np.ndarray) for a in packed.arrays)
            and payload_bytes(packed) <= INLINE_BYTES):
        return pickle.dumps(packed, protocol=pickle.HIGHEST_PROTOCOL)
    return packed


def payload_bytes(packed: Any) -> int:
    """Bytes of tensor data in ``pack_batch``'s result (a ragged list: its tensors')."""
    if packed is None:
        return 0
    if isinstance(packed, PackedBatch):
        return sum(a.nbytes if isinstance(a, np.ndarray) else a.numel() * a.element_size() for a in packed.arrays)
    return sum(t.numel() * t.element_size() for v in packed for t in flatten(v, where="inputs")[1])


def unpack_batch(value: Any, prepare: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> Any:
    """The list ``pack_batch`` was given (from ``to_rpc``'s bytes too); anything else passes through.

    ``prepare`` (pin, upload: Note [step inputs] in actors/step_inputs.py) is applied once to
    each stacked tensor, and the microbatches are views of what it returns; a ragged list
    gets it once per tensor."""
    if isinstance(value, bytes):
        value = pickle.loads(value)
    if not isinstance(value, PackedBatch):
        if prepare is None or not isinstance(value, list):
            return value
        return [unflatten(spec, [prepare(t) for t in tensors])
                for spec, tensors in (flatten(v, where="inputs") for v in value)]
    stacked = [torch.from_numpy(a if a.flags.writeable else a.copy()) if isinstance(a, np.ndarray) else a
               for a in value.arrays]
    if prepare is not None:
        stacked = [prepare(s) for s in stacked]
    return [unflatten(value.spec, [s[i] for s in stacked]) for i in range(value.count)]


def _numpy_or_tensor(t: torch.Tensor) -> Any:
    if t.device.type != "cpu" or t.requires_grad:
        return t
    try:
        return t.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), or a conjugate/negative view
        return t
