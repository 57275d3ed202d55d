"""The cost-model simulator (semantics in DESIGN.md, "Simulator semantics").

Each rank runs its compute actions in order, one at a time.  ``F(s, m)`` waits for
``F(s-1, m)``; the backward (``B`` or ``I``) of ``(s, m)`` waits for the backward of
``(s+1, m)`` (or its own ``F`` on the last stage); ``W(s, m)`` waits for ``I(s, m)``.
A hop between different ranks adds ``comm``.  Send/recv/free/all-reduce actions in a
lowered schedule are ignored here, unless the costs set runtime terms (Note [runtime
costs] in ``costs.py``): then a lowered schedule runs instruction by instruction
(``runtime_sim.py``), and a compute-only one charges ``task`` per compute, the transfer
per cross-rank hop, each stage's data-parallel all-reduce after its last backward and
each rank's optimizer step.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from .actions import Action, BACKWARD_KINDS, COMM_KINDS, COMPUTE_KINDS, Kind, flat
from .costs import Costs
from .dependencies import dependencies, tie_groups
from .errors import ScheduleError
from .runtime_sim import simulate_lowered
from .text import render_order
from .view import ScheduleView


__all__ = ["Costs", "SimResult", "simulate", "dependencies"]

@dataclasses.dataclass(frozen=True)
class SimResult:
    makespan: float
    bubble_fraction: float
    busy: tuple[float, ...]  # per rank, compute time
    idle: tuple[float, ...]  # per rank, makespan - busy
    peak_activations: tuple[int, ...]  # per rank, live forward outputs awaiting backward
    start: dict  # Action -> start time
    end: dict  # Action -> end time
    step_time: float = 0.0  # every rank from time 0 through its optimizer step, plus step_overhead
    rank_end: tuple[float, ...] = ()  # per rank, the end of its optimizer step
    # per rank, the expert all-to-all seconds it waits on, and those its OVERLAPs hid
    # (Note [all-to-all costs] in costs.py); inside ``busy``, which holds the waited ones
    all_to_all: tuple[float, ...] = ()
    all_to_all_hidden: tuple[float, ...] = ()

    @property
    def bubble_time(self) -> float:
        """Idle time of the busiest rank (what the schedule's bubble costs per step)."""
        return self.makespan - max(self.busy)


def simulate(schedule: ScheduleView, costs: Optional[Costs] = None) -> SimResult:
    """Run the schedule's compute actions under the cost model.

    A lowered schedule's tie reductions are charged too: ``TIE_REDUCE g`` starts when
    every rank of group ``g`` has reached it and costs ``costs.tie`` on each (nothing when
    the group lives on one rank).  Raises ``ScheduleError`` naming the stuck action of
    every rank when the order cannot finish (it would deadlock at run time).
    """
    costs = costs or Costs()
    if costs.charges_runtime and any(a.kind in COMM_KINDS for acts in schedule.ranks for a in acts):
        start, end, rank_end, stuck = simulate_lowered(schedule, costs)
        if stuck:
            raise ScheduleError(_stuck_message(schedule, stuck, end))
        orders = [[a for a in acts if a.kind in COMPUTE_KINDS] for acts in schedule.ranks]
    else:
        orders, start, end, rank_end = _simulate_compute(schedule, costs)
    first = [min((start[a] for a in acts), default=0.0) for acts in orders]
    last = [max((end[a] for a in acts), default=0.0) for acts in orders]
    makespan = max((l - f for f, l in zip(first, last) if l > f), default=0.0)
    busy = tuple(sum(costs.of(a) for a in acts) for acts in orders)
    bubble = 1.0 - max(busy) / makespan if makespan > 0 else 0.0
    return SimResult(
        makespan=makespan,
        bubble_fraction=bubble,
        busy=busy,
        idle=tuple(makespan - b for b in busy),
        peak_activations=tuple(_peak_activations(acts) for acts in orders),
        start=start,
        end=end,
        step_time=max(rank_end, default=0.0) + costs.step_overhead,
        rank_end=tuple(rank_end),
        all_to_all=tuple(sum(costs.exposed_a2a(a) for a in acts) for acts in orders),
        all_to_all_hidden=tuple(sum(costs.hidden_a2a(a) for a in acts) for acts in orders),
    )


def _simulate_compute(schedule: ScheduleView, costs: Costs):
    orders = [[a for a in acts if a.kind in COMPUTE_KINDS or a.kind is Kind.TIE_REDUCE] for acts in schedule.ranks]
    rank_of = {p: r for r, acts in enumerate(orders) for a in acts for p in (a, *a.flat)}
    ties = tie_groups(orders)
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    pc = [0] * len(orders)
    clock = [costs.at("launch", r) for r in range(len(orders))]
    last_backward = {} if costs.dp <= 1 else {  # stage -> the action (perhaps an OVERLAP) of its last B or W
        p.stage: a for acts in orders for a in acts for p in a.flat if p.kind in (Kind.B, Kind.W)}
    reduce_after: dict[Action, list[int]] = {}
    for stage, a in sorted(last_backward.items()):
        reduce_after.setdefault(a, []).append(stage)
    remaining = sum(map(len, orders))
    while remaining:
        progressed = False
        for r, acts in enumerate(orders):
            while pc[r] < len(acts):
                a = acts[pc[r]]
                if a.kind is Kind.TIE_REDUCE:
                    members = ties[a.tie_group]
                    if any(pc[m] >= len(orders[m]) or orders[m][pc[m]] != b for m, b in members.items()):
                        break  # a collective: it runs once every member is there
                    t = max(clock[m] for m in members)
                    for m, b in members.items():
                        start[b], end[b] = t, t + (costs.tie if len(members) > 1 else 0.0)
                        clock[m], pc[m] = end[b], pc[m] + 1
                    remaining -= len(members)
                    progressed = True
                    continue
                deps = dependencies(schedule, a)
                if any(d not in end for d in deps):
                    break
                ready = max((end[d] + (costs.transfer(rank_of[d], r, min(d.stage, a.stage)) if rank_of.get(d) != r
                                       else 0.0) for d in deps), default=0.0)
                start[a] = max(clock[r], ready)
                end[a] = clock[r] = start[a] + costs.task + costs.of(a)
                for part in a.parts or ():  # Note [overlapped forward and backward] in actions.py
                    start[part], end[part] = start[a], end[a]
                for stage in reduce_after.get(a, ()):  # its stage's ALLREDUCE follows, as add_allreduce places it
                    clock[r] = costs.allreduce_end(stage, start[a] + costs.task, clock[r])
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: acts[pc[r]] for r, acts in enumerate(orders) if pc[r] < len(acts)}
            raise ScheduleError(_stuck_message(schedule, stuck, end))
    rank_end = [clock[r] + costs.at("optimizer", r) for r in range(len(orders))]  # after its all-reduces
    return orders, start, end, rank_end


def _peak_activations(actions: Sequence[Action]) -> int:
    # Note [activation accounting]: an activation is live from its F until the
    # backward that produces the input gradient (B or I); what W still holds is
    # the smaller weight-gradient residue and is not counted.
    live = peak = 0
    for a in flat(actions):  # an OVERLAP's forward counts before its backward frees
        if a.kind is Kind.F:
            live += 1
            peak = max(peak, live)
        elif a.kind in BACKWARD_KINDS:
            live -= 1
    return peak


def _stuck_message(schedule: ScheduleView, stuck: dict, done: dict) -> str:
    lines = ["the schedule cannot finish: every unfinished rank waits for an action that never runs"]
    for r, a in stuck.items():
        missing = [d for d in dependencies(schedule, a) if d not in done]
        pos = list(schedule.ranks[r]).index(a)
        what = (", ".join(map(repr, missing)) if missing else "its message, never sent" if a.kind in COMM_KINDS
                else f"the other ranks of tie group {a.tie_group}")
        lines.append(f"  rank {r}, position {pos}: {a!r} waits for {what}")
    first_rank, first = next(iter(stuck.items()))
    lines.append(render_order(schedule, mark=(first_rank, list(schedule.ranks[first_rank]).index(first))))
    return "\n".join(lines)
