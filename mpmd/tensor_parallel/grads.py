"""A sharded stage's gradients after the backward, for what the actors do with them next
(the global-norm clip, tie and data-parallel reductions): Note [DTensor gradients]."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Partial

__all__ = ["settle_grads", "norm_terms"]

# Note [DTensor gradients]
# ------------------------
# After a backward through a stage sharded by ``parallelize_module`` (torch 2.13, seen on
# CPU/gloo), a DTensor parameter's gradient does not always have the parameter's
# placements:
# * a vocabulary-parallel embedding (weight Shard(0)) gets a Replicate() gradient: the
#   full [vocab, hidden] on every actor of the group;
# * a replicated weight that sees sharded activations (Qwen3's q_norm/k_norm under
#   SequenceParallel(sequence_dim=2), Note [per-head norms]) gets Partial(sum): each actor
#   holds its heads' share, the sum is still pending.
# An optimizer step redistributes on the fly (``p.add_(grad)`` with mixed placements
# works, and is exact), but anything that reads the local gradient tensors first (a norm,
# a tie or data-parallel all-reduce of ``grad.to_local()``, a fused kernel) would read a
# full copy or a partial sum.  ``settle_grads`` gives every gradient its parameter's
# placements (Replicate -> Shard is a local slice; Partial -> Replicate an all-reduce over
# the group), after which each actor's ``to_local()`` gradient is exactly its shard.
# Plain (not DTensor) parameters are replicated on every actor of the group and see
# replicated activations, so their gradients are already full and equal there.
#
# torch's foreach and fused kernels (``torch._foreach_norm``, ``_foreach_mul_``,
# ``_amp_foreach_non_finite_check_and_unscale_``, SGD/AdamW with ``foreach=True`` or
# ``fused=True``) refuse a list mixing DTensors and plain tensors; pass them the local
# tensors (``norm_terms``, ``g.to_local()``), or step with ``foreach=False`` (the CPU
# default) or one param group per kind.


def settle_grads(module: nn.Module) -> int:
    """Give every DTensor gradient of ``module`` its parameter's placements (Note [DTensor
    gradients]); run on every actor of the group, after the backward.  Returns how many
    gradients were redistributed."""
    moved = 0
    for p in module.parameters():
        g = p.grad
        if isinstance(p, DTensor) and isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)
            moved += 1
    return moved


def norm_terms(module: nn.Module, tp_rank: int) -> list[torch.Tensor]:
    """Plain tensors whose p-norms, raised to p and summed over the TP group, give the p-th
    power of the stage's gradient norm: on every actor its shard of each sharded gradient;
    on the group's rank 0 only, the replicated ones (plain, or Replicate DTensors), so
    they count once.  Needs settled gradients (``settle_grads``)."""
    out = []
    for p in module.parameters():
        g = p.grad
        if g is None:
            continue
        if not isinstance(g, DTensor):
            if tp_rank == 0:
                out.append(g)
            continue
        if any(isinstance(q, Partial) for q in g.placements):
            raise ValueError("a gradient still holds a pending sum (Partial); call settle_grads(module) first "
                             "(Note [DTensor gradients])")
        if g.placements != p.placements:
            raise ValueError(f"a gradient is placed {g.placements} but its parameter {p.placements}; call "
                             f"settle_grads(module) first (Note [DTensor gradients])")
        sharded = any(q.is_shard() for q in g.placements)
        if sharded or tp_rank == 0:
            out.append(g.to_local())
    return out
