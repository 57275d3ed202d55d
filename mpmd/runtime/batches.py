"""Splitting a batch into microbatches and joining outputs back.

How a step's batch becomes the schedule's microbatches is a ``Batching`` strategy the
engine is given: ``MicrobatchSplit`` (equal parts along dim 0) by default; TeraPipe
cuts each part further into token slices (``mpmd.terapipe.TokenSlicing``).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from actors.values import flatten, unflatten

__all__ = ["FED", "Batching", "MicrobatchSplit", "split_batch", "batch_size", "concat_outputs", "signature"]


class _Fed:
    def __repr__(self) -> str:
        return "FED"


# In place of a step's inputs: the actors pull the batch themselves (Note [fed steps] in actors/feed.py).
FED = _Fed()


class Batching(Protocol):
    """How a step's batch becomes the schedule's microbatches, and outputs a batch again."""

    def split(self, inputs: Any, targets: Any, parts: int, hint: str) -> tuple[list, Optional[list]]:
        """``parts`` microbatch values of ``inputs`` and of ``targets`` (None stays None);
        ``hint`` names the options that set ``parts``, for error messages."""

    def join(self, outputs: list) -> Any:
        """The last stage's per-microbatch outputs, in microbatch order, as one batch."""

    def checkpoint_options(self) -> dict:
        """The Pipeline options that rebuild this strategy (``mpmd.Pipeline.load``)."""


class MicrobatchSplit:
    """Equal microbatches along dim 0 (every tensor of a nested value alike)."""

    def split(self, inputs: Any, targets: Any, parts: int, hint: str) -> tuple[list, Optional[list]]:
        mb_in = split_batch(inputs, parts, "inputs", hint)
        mb_tg = split_batch(targets, parts, "targets", hint) if targets is not None else None
        return mb_in, mb_tg

    def join(self, outputs: list) -> Any:
        return concat_outputs(outputs)

    def checkpoint_options(self) -> dict:
        return {}


def _batch_size(tensors: list[torch.Tensor], what: str) -> int:
    if not tensors:
        raise ValueError(f"{what} holds no tensors; pass a tensor or a tuple/dict of tensors")
    sizes = {t.shape[0] if t.dim() else None for t in tensors}
    if None in sizes:
        raise ValueError(f"{what} has a 0-d tensor; every tensor needs a leading batch dimension")
    if len(sizes) > 1:
        raise ValueError(f"{what} tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    return sizes.pop()


def batch_size(value: Any, what: str) -> int:
    """The leading dimension every tensor of ``value`` shares."""
    try:
        _, tensors = flatten(value, where=what)
    except TypeError as e:
        raise ValueError(str(e)) from None
    return _batch_size(tensors, what)


def split_batch(value: Any, parts: int, what: str, hint: str) -> list[Any]:
    """Split along dim 0 into ``parts`` equal microbatches, or say how to fix the sizes."""
    try:
        spec, tensors = flatten(value, where=what)
    except TypeError as e:
        raise ValueError(str(e)) from None
    n = _batch_size(tensors, what)
    if n == 0:
        raise ValueError(f"{what} is empty (batch size 0)")
    if n % parts:
        lo, hi = (n // parts) * parts, (n // parts + 1) * parts
        raise ValueError(
            f"{what} has batch size {n}, which does not split into {parts} equal microbatches ({hint}); "
            f"use a batch size divisible by {parts}, e.g. {lo or hi} or {hi}"
        )
    chunks = [t.chunk(parts) for t in tensors]
    return [unflatten(spec, [c[i] for c in chunks]) for i in range(parts)]


def concat_outputs(outputs: list[Any]) -> Any:
    spec, _ = flatten(outputs[0], where="stage output")
    flats = [flatten(o)[1] for o in outputs]
    return unflatten(spec, [torch.cat(ts) for ts in zip(*flats)])


def signature(value: Any) -> tuple:
    """Structure, shapes and dtypes: when it changes, actors relearn transfer shapes."""
    if value is None:
        return ()
    spec, tensors = flatten(value)
    return (repr(spec), tuple((tuple(t.shape), t.dtype) for t in tensors))
