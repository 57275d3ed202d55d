"""The expert all-to-all (Note [expert parallelism] in actors/experts.py): issued asynchronously
and waited for, yielding to the other side inside an overlap (Note [overlap turns] in
actors/overlap.py), and recorded for profiled steps."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .overlap import running_baton

__all__ = ["ExchangeLog", "EXCHANGES", "exchange", "AllToAll", "by_host"]


class ExchangeLog:
    """The all-to-alls of a profiled step as ``(start_ns, end_ns, what)`` on the host clock
    (``what``: "counts", "dispatch", "combine", and "dispatch grad" / "combine grad" in the
    backward).  The interpreter turns recording on for profiled steps and takes the spans after
    each instruction, so the profile shows them inside the instruction that ran them.  A span is
    the time the issuing side was held up by the exchange: from its issue to its end, or inside
    an overlap from when the side has the baton back to the end (the time the other side
    computed meanwhile is hidden, not blocked).  On CUDA with NCCL the wait returns once the
    exchange is queued on the stream; on gloo it includes waiting for the slowest member.

    Each record also keeps when the exchange was issued (``issued_ns <= start_ns``): from
    issue to end it was in flight, and what of that the side was not held up (``start_ns -
    issued_ns``, the other side's compute inside an overlap, 0 outside) was hidden
    (mpmd/profiler/exchanges.py, Note [hidden all-to-all])."""

    def __init__(self) -> None:
        self.recording = False
        # (start_ns, end_ns, what, issued_ns), appended by either side of an overlap (one at a time: the baton)
        self.spans: list[tuple[int, int, str, int]] = []

    def take(self) -> list[tuple[int, int, str]]:
        """The blocked spans ``(start_ns, end_ns, what)`` recorded since the last take."""
        return [span[:3] for span in self.take_flights()]

    def take_flights(self) -> list[tuple[int, int, str, int]]:
        """The records ``(start_ns, end_ns, what, issued_ns)`` since the last take."""
        spans, self.spans = self.spans, []
        return spans


EXCHANGES = ExchangeLog()  # this process's (an actor runs one step at a time)


def exchange(what: str, issue: Callable[[], Any]) -> None:
    """Run one all-to-all: ``issue()`` starts it (``async_op=True``) and returns its work; inside
    an overlap the other side computes until the baton comes back (Note [overlap turns])."""
    baton = running_baton()
    if baton is not None:
        baton.hold()  # the issue order must not depend on which thread got there first
    issued = t0 = time.time_ns()
    work = issue()
    if baton is not None:
        baton.turn()
        t0 = time.time_ns()
    work.wait()
    if EXCHANGES.recording:
        EXCHANGES.spans.append((t0, time.time_ns(), what, issued))


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes whose backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list, in_splits: list, group, what: str) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.what = group, out_splits, in_splits, what
        return _exchange(x, out_splits, in_splits, group, what)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _exchange(grad.contiguous(), ctx.in_splits, ctx.out_splits, ctx.group, f"{ctx.what} grad")
        return back, None, None, None, None


def by_host(t: torch.Tensor, group) -> bool:
    """Whether ``t`` must go through a host copy on ``group``: gloo moves host tensors only, and
    actors sharing a GPU (the staged transport) hold CUDA ones."""
    return t.is_cuda and dist.get_backend(group) == "gloo"


def _exchange(x: torch.Tensor, out_splits: list, in_splits: Optional[list], group, what: str) -> torch.Tensor:
    staged = by_host(x, group)
    src = x.detach().cpu() if staged else x.detach()
    src = src.contiguous()
    out = src.new_empty((sum(out_splits) if out_splits is not None else src.shape[0],) + tuple(src.shape[1:]))
    exchange(what, lambda: dist.all_to_all_single(out, src, out_splits, in_splits, group=group, async_op=True))
    return out.to(x.device) if staged else out
