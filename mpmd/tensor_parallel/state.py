"""Full tensors in and out of a sharded stage: ``state_dict()`` under the model's keys at any
``tp``, and loading a full state dict (saved at ``tp=1``, or gathered) at any ``tp``."""

from __future__ import annotations

from typing import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["full_state_dict", "load_full_state_dict"]


def full_state_dict(module: nn.Module) -> dict:
    """``module.state_dict()`` with every DTensor gathered into its full tensor.  A collective:
    every actor of the group calls it (each gets the whole state dict)."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in module.state_dict().items()}


@torch.no_grad()
def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy full tensors (``full_state_dict``'s, or a ``tp=1`` stage's ``state_dict()``) into a
    sharded ``module``: each actor keeps its own slice of every sharded tensor, no
    communication.  The keys must be exactly the module's."""
    own = module.state_dict()
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"the state dict does not fit the stage: missing keys {missing[:5]}, unexpected keys "
                         f"{unexpected[:5]}; load the state dict of this stage (the model's keys it holds)")
    for key, target in own.items():
        full = state_dict[key]
        if isinstance(full, DTensor):
            raise ValueError(f"{key!r} is a DTensor; pass full tensors (full_state_dict gathers them)")
        if tuple(full.shape) != tuple(target.shape):
            raise ValueError(f"{key!r} has shape {tuple(full.shape)} in the state dict but {tuple(target.shape)} in "
                             f"the stage")
        if isinstance(target, DTensor):
            part = distribute_tensor(full.to(target.dtype), target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(part.to_local())
        else:
            target.copy_(full)
