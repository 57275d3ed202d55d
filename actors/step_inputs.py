"""A step's data on its way to the device: the batch pinned once, side inputs uploaded once.

Note [step inputs]
------------------
The controller packs each tensor of a step's microbatches into one stacked array
(``PackedBatch`` in actors/values.py); the actor unpacks it into per-microbatch views.
What each forward then does with a microbatch is ``to_device`` (``slot.inp``, the target):

* **Inputs and targets** are uploaded per microbatch (the copy overlaps the previous
  microbatch's kernels; the whole batch is never resident on the GPU at once), but on
  CUDA they are *pinned once per step*: each stacked tensor is pinned in one call when the
  step begins, so every microbatch is a view of pinned memory and its upload is one
  asynchronous copy, not a pin (a host allocation and a host copy) and a copy per
  microbatch.  Fed steps (Note [fed steps] in actors/feed.py) pin the pulled batch before
  it is cut into microbatches.  The pinned buffers live in the ``StepState`` until the
  step ends; CUDA's caching host allocator keeps a freed block until the copies queued
  from it are done.
* **Side inputs** (mpmd/runtime/side.py) are small (masks, position ids) and may be taken
  by several local stages and the loss: each is uploaded *once per step* when it begins,
  one stacked copy per tensor, and every stage and microbatch takes a view of it, instead
  of an upload per microbatch and stage.

On the CPU both are the identity: the values are the tensors they were, bit for bit.
``pin`` and ``upload`` are injected, so the once-per-step rule is tested on the CPU with
counting fakes (tests/actors/test_step_inputs.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from .values import flatten, to_device, unflatten, unpack_batch

__all__ = ["StepInputs", "step_inputs", "pinned", "uploader"]

Prepare = Callable[[torch.Tensor], torch.Tensor]


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned host memory (a device tensor, or one already pinned, as it is)."""
    return t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t


def uploader(device: torch.device) -> Prepare:
    return lambda t: to_device(t, device)


@dataclasses.dataclass(frozen=True)
class StepInputs:
    """How a step's data is prepared on this actor's device (Note [step inputs]); None: as it is."""

    pin: Optional[Prepare] = None  # applied once to each host tensor of the batch
    upload: Optional[Prepare] = None  # applied once to each side tensor

    @staticmethod
    def for_device(device: torch.device) -> "StepInputs":
        return StepInputs(pinned, uploader(device)) if device.type == "cuda" else StepInputs()

    def batch(self, value: Any) -> Optional[list]:
        """``unpack_batch(value)``, each stacked tensor pinned once (microbatches are views of it)."""
        return unpack_batch(value, prepare=self.pin)

    def whole(self, value: Any) -> Any:
        """One value (a fed batch before it is cut) with its tensors pinned."""
        if self.pin is None or value is None:
            return value
        spec, tensors = flatten(value, where="fed batch")
        return unflatten(spec, [self.pin(t) for t in tensors])

    def side(self, side: Optional[tuple]) -> tuple[dict, dict]:
        """``(per microbatch, whole)`` side inputs, each tensor uploaded once for the step."""
        per_mb, whole = side or ({}, {})
        up = self.upload
        return ({n: unpack_batch(v, prepare=up) for n, v in per_mb.items()},
                {n: up(v) if up is not None and isinstance(v, torch.Tensor) else v for n, v in whole.items()})


def step_inputs(prep: StepInputs, inputs: Any, targets: Any, side: Optional[tuple],
                pull: Optional[Callable] = None) -> tuple[Optional[list], Optional[list], dict, dict]:
    """``(inputs, targets, side per microbatch, side whole)`` for a step.  ``pull``: a fed
    step's ``Feed.pull`` / ``TargetsFrom.pull`` (given ``prep.whole`` to pin before cutting)."""
    if pull is not None:
        inputs, targets = pull(prep.whole)
    else:
        inputs, targets = prep.batch(inputs), prep.batch(targets)
    per_mb, whole = prep.side(side)
    return inputs, targets, per_mb, whole
