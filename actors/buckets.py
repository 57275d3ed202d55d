"""Gradient buckets of the data-parallel reduction: tensors grouped into flat messages
(``bucket_tensors``) and one bucket's average under way (``PendingMean``, started by
``Communicator.start_mean``; Note [overlapped dp reduction] in dp_reduce.py)."""

from __future__ import annotations

import torch

__all__ = ["PendingMean", "bucket_tensors"]


class PendingMean:
    """One bucket's average under way (``Communicator.start_mean``): ``wait`` waits for the
    collective (on CUDA: the caller's stream waits for NCCL's) and writes the mean back."""

    def __init__(self, work, bucket: list[torch.Tensor], flat: torch.Tensor, wire: torch.Tensor, dp: int,
                 pin: bool) -> None:
        self.work, self.bucket, self.flat, self.wire, self.dp, self.pin = work, bucket, flat, wire, dp, pin

    def wait(self) -> None:
        self.work.wait()
        flat = self.flat
        if self.wire is not flat:  # staged: straight from the pinned buffer, no second device buffer
            flat.copy_(self.wire, non_blocking=self.pin)
        flat.div_(self.dp)
        if flat is self.bucket[0]:
            return
        for t, piece in zip(self.bucket, flat.split([t.numel() for t in self.bucket])):
            t.copy_(piece.view_as(t))


def bucket_tensors(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_bytes``
    together; a tensor larger than that travels alone."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        head = buckets[-1][0] if buckets else None
        fits = (head is not None and head.dtype == t.dtype and head.device == t.device
                and size + nbytes <= bucket_bytes)
        if fits:
            buckets[-1].append(t)
            size += nbytes
        else:
            buckets.append([t])
            size = nbytes
    return buckets
