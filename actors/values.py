"""Values passed between stages: a tensor, or a tuple/list/dict of tensors (nested).

A value is flattened into its tensors plus a small structure ``spec`` so it can
travel as a few point-to-point messages and be rebuilt on the other side.
"""

from __future__ import annotations

from typing import Any

import msgpack
import torch

__all__ = ["flatten", "unflatten", "TensorMeta", "meta_of", "encode_header", "decode_header", "HEADER_BYTES"]

# A header announces the structure, shapes and dtypes of the next value on a channel.
HEADER_BYTES = 4096

TensorMeta = tuple  # (shape tuple, dtype name)


def flatten(value: Any, where: str = "stage output") -> tuple[Any, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def walk(v):
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            return "T"
        if isinstance(v, (tuple, list)):
            return ["L" if isinstance(v, list) else "U", [walk(x) for x in v]]
        if isinstance(v, dict):
            if not all(isinstance(k, str) for k in v):
                raise TypeError(f"{where}: dict values between stages need str keys, got {list(v)!r}")
            return ["D", [[k, walk(x)] for k, x in v.items()]]
        raise TypeError(
            f"{where} is a {type(v).__name__}; values passed between stages must be a tensor "
            "or a tuple/list/dict of tensors"
        )

    return walk(value), tensors


def unflatten(spec: Any, tensors: list[torch.Tensor]) -> Any:
    it = iter(tensors)

    def build(s):
        if s == "T":
            return next(it)
        tag, items = s
        if tag == "D":
            return {k: build(x) for k, x in items}
        seq = [build(x) for x in items]
        return seq if tag == "L" else tuple(seq)

    return build(spec)


def meta_of(tensors: list[torch.Tensor]) -> list[TensorMeta]:
    return [(tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in tensors]


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
