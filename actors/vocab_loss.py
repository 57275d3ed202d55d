"""Cross-entropy on logits sharded over the vocabulary, holding one shard-sized buffer: the
last stage's loss under ``Pipeline(loss_parallel=True)`` (Note [vocabulary-parallel loss] in
mpmd/tensor_parallel/builtin.py), which ``mpmd.planning.causal_lm_loss`` and
``mpmd.models.lm_loss`` call on sharded logits; ``mpmd.tensor_parallel`` exports it."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

__all__ = ["vocab_parallel_cross_entropy"]


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, ignore_index: int = -100,
                                 reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(logits.reshape(-1, V), target.reshape(-1))`` for ``logits`` of shape
    ``(..., V)``.  A DTensor sharded over the vocabulary on a one-dimensional mesh (the head of
    ``Pipeline(loss_parallel=True)``) is reduced on its shards: each rank keeps its shard's
    softmax in float32 and nothing whole (Note [memory of the loss] below); the loss, a plain
    tensor, is the same on every rank.  A plain tensor goes to ``F.cross_entropy``."""
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if not isinstance(logits, DTensor):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1).to(logits.device),
                               ignore_index=ignore_index, reduction=reduction)
    mesh, placements = logits.device_mesh, tuple(logits.placements)
    if mesh.ndim != 1 or not (placements[0].is_shard() and placements[0].dim in (-1, logits.ndim - 1)):
        raise ValueError(f"vocab_parallel_cross_entropy takes logits sharded over the vocabulary (the last dim) on a "
                         f"one-dimensional mesh, got placements {placements} on a {mesh.ndim}-D mesh; leave the LM "
                         f"head's output as ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)")
    vocab, size = logits.shape[-1], mesh.size()
    if vocab % size:
        raise ValueError(f"the vocabulary ({vocab}) does not split evenly over the {size} ranks of the mesh")
    local = logits.to_local()
    rows = local.reshape(-1, local.shape[-1])
    target = target.reshape(-1).to(rows.device)
    if target.shape[0] != rows.shape[0]:
        raise ValueError(f"{rows.shape[0]} rows of logits but {target.shape[0]} targets")
    start = mesh.get_local_rank() * (vocab // size)
    losses = _ShardedCrossEntropy.apply(rows, target, start, mesh.get_group(), ignore_index)
    if reduction == "none":
        return losses.view(target.shape)
    if reduction == "sum":
        return losses.sum()
    return losses.sum() / (target != ignore_index).sum()


# Note [memory of the loss]
# -------------------------
# ``torch.distributed.tensor.parallel.loss_parallel`` (which a ``loss_fn`` calling
# ``F.cross_entropy`` on the sharded logits runs under) keeps the log-softmax and, on the
# way, holds three shard-sized temporaries in the forward (shifted logits, their
# exponentials, the result) and about as many in the backward: at tp=2 the last stage then
# held more than the whole vocabulary's loss at tp=1 (measured: 146 against 143 MiB of peak
# growth per step, test_tensor_parallel_memory.py's model).  Here, as Megatron computes it,
# the forward makes one float32 buffer of the shard (the logits minus the row maximum over
# the group), exponentiates and normalizes it in place into the softmax, which is all it
# keeps; each row's target logit comes from the rank holding it (zero elsewhere), and one
# all-reduce sums the rows' exponentials and target logits, after one that takes the row
# maxima.  The backward makes one buffer (softmax times the incoming gradient, minus it at
# the target) and leaves the saved softmax as it is, so a second backward through the node
# (the split backward's fallback, Note [weight seeds]) is still right.


class _ShardedCrossEntropy(torch.autograd.Function):
    """Per row: ``log(sum_v exp(x_v)) - x_target`` over the group's shards (0 at ``ignore_index``)."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, target: torch.Tensor, start: int, group: Optional[dist.ProcessGroup],
                ignore_index: int) -> torch.Tensor:
        width = rows.shape[1]
        row_max = rows.detach().amax(dim=1).float()
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        probs = rows.detach().float() - row_max.unsqueeze(1)  # the one shard-sized buffer (a new tensor)
        valid = target != ignore_index
        here = valid & (target >= start) & (target < start + width)
        index = torch.where(here, target - start, 0).unsqueeze(1)
        sums = torch.stack([torch.zeros_like(row_max), probs.gather(1, index).squeeze(1) * here])
        probs.exp_()
        sums[0] = probs.sum(dim=1)
        dist.all_reduce(sums, group=group)  # the rows' sums of exponentials and (shifted) target logits
        probs.div_(sums[0].unsqueeze(1))
        ctx.save_for_backward(probs, index, here, valid)
        ctx.dtype = rows.dtype
        return torch.where(valid, sums[0].log() - sums[1], 0.0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        probs, index, here, valid = ctx.saved_tensors
        scale = torch.where(valid, grad, 0.0).unsqueeze(1)
        out = probs * scale
        out.scatter_add_(1, index, -(scale * here.unsqueeze(1)))
        return out.to(ctx.dtype), None, None, None, None
