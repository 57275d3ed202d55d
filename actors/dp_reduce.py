"""A stage's data-parallel gradient average started inside its last backward.

Note [overlapped dp reduction]
------------------------------
With ``dp > 1`` (and ``overlap_reduce``, the default) a stage's gradients are averaged over
the replicas bucket by bucket while its last backward of the step is still running, as
torch DDP's reducer does, instead of all at once at its ``ALLREDUCE``.

* Buckets are fixed at set-up: the parameters that require gradients, in reverse order
  (a backward makes the last layers' gradients final first), cut at ``bucket_bytes``
  (``bucket_tensors``).  Under ``zero=1`` the tied ones are bucketed apart and all-reduced
  whole, the others reduce-scattered with each bucket ordered owner after owner (Note
  [ZeRO-1 sharding] in actors/zero.py); buckets are ordered by their last member.
* Right before the stage's last backward instruction of the program (its last ``B``, or
  with a split backward its last ``W``: ``I`` accumulates no parameter gradient, Note
  [weight seeds]) the worker *arms* the stage: a post-accumulate-grad hook on each such
  parameter.  A gradient accumulated there is final: a parameter accumulates once per
  backward (autograd sums a leaf's uses before its ``AccumulateGrad``; ``W``'s weight
  seeds own disjoint parameters; a recomputed forward runs inside ``B`` or at ``I`` and
  accumulates nothing).  When every member of the next bucket is final, it starts
  (``async_op=True``: NCCL's own stream, which waits for the compute stream the hook ran
  on, or gloo's thread), and so do the ready buckets after it.  Buckets start in their
  fixed order only, so every replica issues the same collectives in the same order.
* The stage's ``ALLREDUCE`` (still after its last backward and that backward's send,
  ``add_allreduce``) is the wait: the hooks go, the buckets not started yet start with
  their members that have a gradient (one that got none in the last backward, or none at
  all, is left out as the synchronous path leaves it out), then each is waited for in
  order (``work.wait()``: on CUDA the actor's stream waits for NCCL's) and its mean
  written back (ZeRO-1: the owned gradients; the others dropped).  So the tie reduction,
  the clipping norm and the optimizer step after it read averaged gradients as before,
  and the result is the same: the same sums per element, in other messages.
* On CUDA the autograd engine runs ``AccumulateGrad`` (so the hooks and the collectives
  they start) on its device thread while the actor's thread waits inside ``backward()``:
  never two threads in the communicator at once.
* Not overlapped: a stage with DTensor parameters (tensor parallelism: ``align_grads`` may
  run TP collectives first, which a hook cannot start in step), and ``overlap_reduce=False``:
  they take the synchronous path (``average_gradients``).  The window is the rest of the
  stage's last backward and its send; the actor's later work on other stages does not
  overlap it, which keeps the dp and tie collectives in Note [tie reduction]'s order.
* Expert parameters (``ep > 1``) are in no bucket: their gradients are summed over the EDP
  group and divided by ``dp x cp`` after the buckets, at the same ``ALLREDUCE`` (``average_experts``;
  Note [expert parallelism] in actors/grid.py).
* A profiled step records, per stage, a ``DP_REDUCE`` entry from the first bucket started
  to the wait's end (actors/protocol.py), and ``Costs.overlap_reduce`` charges only what
  is exposed (Note [runtime costs] in schedules/costs.py).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor

from schedules import Kind

from .buckets import bucket_tensors
from .comm import Communicator
from .program import flat_program
from .zero import ZeroStage, start_scatter

__all__ = ["StageReduction", "stage_reductions", "last_backwards", "average_experts"]


def last_backwards(program: list) -> dict[int, int]:
    """``{position: stage}``: per stage with an ``ALLREDUCE`` in ``program``, its last ``B``
    or ``W`` (maybe inside an ``OVERLAP``: its position), where the stage is armed (Note
    [overlapped dp reduction])."""
    reduced = {ins.stage for ins in program if ins.kind is Kind.ALLREDUCE}
    last = {ins.stage: i for i, ins in flat_program(program) if ins.kind in (Kind.B, Kind.W) and ins.stage in reduced}
    return {i: s for s, i in last.items()}


def stage_reductions(modules: dict[int, torch.nn.Module], zero: dict[int, ZeroStage], comm: Communicator,
                     bucket_bytes: int, expert_ids: frozenset = frozenset()) -> dict[int, "StageReduction"]:
    """A ``StageReduction`` per stage that has dense parameters to average and no DTensor ones
    (``expert_ids``: the expert parameters, averaged apart by ``average_experts``)."""
    out = {}
    for s, module in modules.items():
        params = [p for p in module.parameters() if p.requires_grad and id(p) not in expert_ids]
        if params and comm.dp_group is not None and not any(isinstance(p, DTensor) for p in params):
            out[s] = StageReduction(comm, params, zero.get(s), bucket_bytes)
    return out


def average_experts(comm: Communicator, params: list[torch.Tensor], dp: int, bucket_bytes: int) -> None:
    """A stage's expert gradients averaged as the dense ones are (Note [expert parallelism] in
    actors/grid.py): each already sums its EP group's tokens (the all-to-all's backward), so
    summed over the EDP group (the members holding the same experts) and divided by ``dp`` (the
    ``dp x cp`` members of the rank's gradient average)."""
    with torch.no_grad():
        for p in params:  # every member sums the same tensors, whether its tokens reached them or not
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.requires_grad]
        if not grads:
            return
        comm.expert_sum(grads, bucket_bytes)
        for g in grads:
            g.div_(dp)


class StageReduction:
    """One stage's buckets and, while armed, which of their gradients are final
    (Note [overlapped dp reduction])."""

    def __init__(self, comm: Communicator, params: list[torch.Tensor], zs: Optional[ZeroStage],
                 bucket_bytes: int) -> None:
        self.comm, self.zs, self.params = comm, zs, params
        order = params[::-1]
        if zs is None:
            buckets = [(False, b) for b in bucket_tensors(order, bucket_bytes)]
        else:
            tied = [p for p in order if id(p) in zs.tied]
            rest = [p for p in order if id(p) not in zs.tied]
            buckets = ([(False, b) for b in bucket_tensors(tied, bucket_bytes)]
                       + [(True, zs.owner_major(b)) for b in bucket_tensors(rest, bucket_bytes)])
            at = {id(p): i for i, p in enumerate(order)}
            buckets.sort(key=lambda sb: max(at[id(p)] for p in sb[1]))
        self.buckets = buckets  # (reduce-scattered, members)
        self.bucket_of = {id(p): i for i, (_, b) in enumerate(buckets) for p in b}
        self.hooks: list = []
        self.round = _Round(buckets, None)  # this arming's progress (a new one each ``arm``)

    def arm(self, mark: Optional[Callable[[], Any]]) -> None:
        """Before the stage's last backward: start each bucket once its gradients are final
        (``mark``: the profiling timer's, or None)."""
        self.disarm()
        self.round = _Round(self.buckets, mark)
        self.hooks = [p.register_post_accumulate_grad_hook(self._final) for p in self.params]

    def disarm(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []

    def _final(self, p: torch.Tensor) -> None:
        r = self.round
        if id(p) in r.final:  # an internal invariant: each parameter accumulates once per backward
            raise RuntimeError(f"a gradient of shape {tuple(p.shape)} accumulated twice in the stage's last "
                               f"backward, after it was taken as final (Note [overlapped dp reduction])")
        r.final.add(id(p))
        i = self.bucket_of[id(p)]
        r.left[i] -= 1
        while r.next < len(self.buckets) and r.left[r.next] == 0:
            self._start(r.next)

    def _start(self, i: int) -> None:
        r = self.round
        r.next = i + 1
        scatter, bucket = self.buckets[i]
        members = [p for p in bucket if p.grad is not None]
        if not members:
            return
        if r.first is None and r.mark is not None:
            r.first = r.mark()
        with torch.no_grad():
            if scatter:
                r.pending.append(start_scatter(self.comm, self.zs, members))
            else:
                r.pending.append(self.comm.start_mean([p.grad for p in members]))

    def finish(self) -> Any:
        """The stage's ``ALLREDUCE``: start what is left, wait for every bucket; when profiling,
        the mark of the first bucket's start (None: nothing was averaged)."""
        self.disarm()
        while self.round.next < len(self.buckets):
            self._start(self.round.next)
        with torch.no_grad():
            for work in self.round.pending:
                work.wait()
        first = self.round.first
        self.round = _Round(self.buckets, None)
        return first


class _Round:
    """One arming of a ``StageReduction``: which gradients are final and which buckets started."""

    def __init__(self, buckets: list, mark: Optional[Callable[[], Any]]) -> None:
        self.left = [len(b) for _, b in buckets]  # members not final yet, per bucket
        self.final: set[int] = set()  # ids of the parameters whose gradient is final
        self.next = 0  # the first bucket not started
        self.pending: list = []  # the started buckets' collectives
        self.first: Any = None  # when the first bucket started (a timer mark), when profiling
        self.mark = mark
