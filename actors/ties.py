"""Parameters that several stages share (tied embeddings), on one actor: each stage holds
its own copy; ``TIE_REDUCE`` gives every copy the sum of all copies' gradients, over the
actors of the tie too, so each copy steps as the one shared parameter would (Note [tie
reduction] in ``schedules/passes.py``)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .comm import Communicator
from .protocol import TieGroup
from .tensor_parallel import align_grads, check_tie_placements, local, placement_of

__all__ = ["TiedCopies"]


class TiedCopies:
    """The local copies of one tie's parameters: ``copies[k]`` are parameter ``k``'s copies,
    one per local stage of the tie."""

    def __init__(self, tie: TieGroup, modules: dict[int, torch.nn.Module]) -> None:
        self.group = tie.group
        per_stage = []
        for s, names in sorted(tie.names.items()):
            params = dict(modules[s].named_parameters(remove_duplicate=False))
            per_stage.append([params[n] for n in names])
        self.copies = [list(ps) for ps in zip(*per_stage, strict=True)]
        for copies, names in zip(self.copies, zip(*sorted(tie.names.values()), strict=True)):
            check_tie_placements(copies, list(names))  # under TP, shard by shard (Note [tensor parallelism])

    def layouts(self) -> list[tuple]:
        """How each of the tie's parameters is laid out over the TP group here (``str`` of its placements)."""
        return [tuple(map(str, placement_of(copies[0]))) for copies in self.copies]

    def reduce(self, comm: Communicator, bucket_bytes: int) -> None:
        """Every copy's gradient becomes the sum over all copies of the tie, here and on the
        tie's other actors (a copy without a gradient counts as zeros)."""
        align_grads([p for copies in self.copies for p in copies])
        totals = []
        for copies in self.copies:  # a DTensor's own shard: every copy is sharded alike (Note [tensor parallelism])
            grads = [local(p.grad) for p in copies if p.grad is not None]
            total = grads[0].clone() if grads else torch.zeros_like(local(copies[0]))
            for g in grads[1:]:
                total += g
            totals.append(total)
        if self.group >= 0:
            comm.allreduce_sum(totals, self.group, bucket_bytes)
        for copies, total in zip(self.copies, totals, strict=True):
            for j, p in enumerate(copies):  # each its own tensor: optimizers may update gradients in place
                g = total if j == 0 else total.clone()
                p.grad = (DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                          if isinstance(p, DTensor) else g)
