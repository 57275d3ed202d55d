"""Fusing a split backward back into one ``B`` where splitting buys nothing.

Note [fused where free]
-----------------------
The zero-bubble generators split every backward into ``I`` (input gradient) and ``W``
(weight gradients), and write a fused backward as a ``W`` right after its ``I``.  Run
as two autograd passes, such a pair costs more than one fused ``B``: measured alone on
the bench's stages, 1.05x on 8 x Linear(1024) and 2.35x on 8 x Linear(64) (docs/profiling.md).
What the split buys is that the input gradient leaves ``w`` earlier.  So
``fuse_backwards`` simulates the schedule once and turns an ``I`` directly followed on
its rank by its own ``W`` into one ``B`` (also an ``I`` inside an ``OVERLAP``, which then
overlaps the ``B``) wherever that earlier gradient is not used:

* on the first stage (nothing consumes its input gradient);
* where the consumer (the previous stage's backward of that microbatch) starts, in the
  simulated timeline, no earlier than the hop after the ``W`` ends.

Then no action starts later: the fused ``B`` ends no later than the ``W`` did (it costs
``Costs.backward``, at most ``b + w``), and the consumer was waiting that long anyway;
by induction over the timeline nothing else waits longer either.  Memory is the same
(the ``W`` ran right after its ``I``).  torch's ``ScheduleDualPipeV`` makes the same choice by construction:
its steady state pairs a forward with a fused backward and splits only in the warm-up
and the drain.  The simulation uses ``costs`` (unit costs by default, the model the
lowering orders messages by, Note [deadlock-free ordering] in passes.py), so with other
costs a fused pair may cost a little time the split one would not; the runtime fuses
the named schedules under unit costs (``build_schedule``), and a ``Schedule`` a user
builds runs as written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from .actions import Action, Kind
from .costs import Costs
from .simulate import simulate

if TYPE_CHECKING:
    from .schedule import Schedule

__all__ = ["fuse_backwards"]


def fuse_backwards(schedule: "Schedule", costs: Optional[Costs] = None) -> "Schedule":
    """``schedule`` with each ``I`` + ``W`` pair whose split the timeline does not use
    fused into one ``B`` (Note [fused where free]); the schedule itself when none is."""
    costs = costs or Costs()
    sim = simulate(schedule, costs)
    owner = schedule.stage_to_rank
    fused = set()
    for r, acts in enumerate(schedule.ranks):
        for top, nxt in zip(acts, acts[1:]):
            a = top.flat[-1]  # an OVERLAP's backward may be an I with its W right after the OVERLAP
            s, k, m = a.stage, a.kind, a.microbatch
            if k is not Kind.I or nxt != Action(s, Kind.W, m):
                continue
            if s > 0:
                consumer = Action(s - 1, schedule.backward_of(s - 1, m), m)
                hop = costs.transfer(r, owner[s - 1], s - 1) if owner[s - 1] != r else 0.0
                if sim.start[consumer] < sim.end[nxt] + hop:
                    continue  # the consumer uses the gradient as soon as it is there
            fused.add((s, m))
    if not fused:
        return schedule
    ranks = tuple(tuple(_fused(a) if (a.flat[-1].stage, a.flat[-1].microbatch) in fused else a for a in acts
                        if not (a.kind is Kind.W and (a.stage, a.microbatch) in fused))
                  for acts in schedule.ranks)
    return schedule.replace(ranks=ranks)


def _fused(a: Action) -> Action:
    if a.parts is not None:
        return Action.overlap(a.parts[0], _fused(a.parts[1]))
    return Action(a.stage, Kind.B, a.microbatch) if a.kind is Kind.I else a
