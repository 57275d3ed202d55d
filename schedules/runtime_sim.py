"""The simulator at instruction level: a lowered schedule under the runtime terms of
the cost model (Note [runtime costs] in ``costs.py``; DESIGN.md, "Simulator semantics").

Every rank starts at its ``launch``; every instruction runs in its rank's order and
pays ``task``.  ``SEND_*`` pays ``send`` (unset: ``message``) and posts the message;
its transfer (``Costs.transfer``) starts once the receive is posted too: at the send
for a receive posted ``prefetch`` receives ahead (the runtime's ``irecv``), else when
the receiver reaches the ``RECV_*``.  A receive ends when the message has arrived, plus
``message``.  A compute waits for its producers on the rank and for the receive of each
message it consumes (an OVERLAP: both parts' producers and messages); it costs ``Costs.of``, which with ``tp > 1`` is one TP rank's
share of the compute plus the stage's TP all-reduces (Note [runtime costs]).  A data-parallel ``ALLREDUCE`` holds its rank for
``Costs.allreduce`` more, or (``overlap_reduce``) what of it the stage's last backward did not cover (``Costs.allreduce_end``).  After its program a rank waits for its sends to be delivered
(the runtime's flush), steps its optimizer and (ZeRO-1) all-gathers its parameters; the step ends with the last rank, plus
``step_overhead``.
"""

from __future__ import annotations


from .actions import Action, COMPUTE_KINDS, Kind
from .costs import Costs
from .dependencies import dependencies, tie_groups
from .view import ScheduleView


__all__ = ["simulate_lowered", "Timing"]

# SEND kind -> (matching RECV kind, stage offset of the receiving stage)
_PAIR = {Kind.SEND_F: (Kind.RECV_F, +1), Kind.SEND_B: (Kind.RECV_B, -1)}
_SENT_BY = {Kind.RECV_F: (Kind.SEND_F, -1), Kind.RECV_B: (Kind.SEND_B, +1)}


class Timing(tuple):
    """``(start, end, rank_end, stuck)``: per action start and end, per rank the end of its
    optimizer step, and the stuck action of each rank (empty unless it cannot finish)."""


def simulate_lowered(schedule: ScheduleView, costs: Costs) -> Timing:
    orders = [list(acts) for acts in schedule.ranks]
    owner = schedule.stage_to_rank
    start: dict[Action, float] = {}
    end: dict[Action, float] = {}
    sent: dict[Action, float] = {}  # RECV action it pairs with -> time its send was posted
    recv_ends: list[list[float]] = [[] for _ in orders]  # per rank, ends of its receives in order
    got: dict[tuple[Action, int], float] = {}  # (producer compute, consuming rank) -> receive end
    flush = [0.0] * len(orders)  # per rank, the last arrival of its sends
    began: dict[int, float] = {}  # stage -> when its latest B or W began (Costs.allreduce_end)
    ties = tie_groups(orders)
    pc, clock = [0] * len(orders), [costs.at("launch", r) for r in range(len(orders))]
    remaining = sum(map(len, orders))
    while remaining:
        progressed = False
        for r, acts in enumerate(orders):
            while pc[r] < len(acts):
                a = acts[pc[r]]
                k = a.kind
                if k is Kind.TIE_REDUCE:
                    members = ties[a.tie_group]
                    if any(pc[m] >= len(orders[m]) or orders[m][pc[m]] != b for m, b in members.items()):
                        break
                    t = max(clock[m] for m in members)
                    for m, b in members.items():
                        start[b], end[b] = t, t + costs.task + (costs.tie if len(members) > 1 else 0.0)
                        clock[m], pc[m] = end[b], pc[m] + 1
                    remaining -= len(members)
                    progressed = True
                    continue
                t0 = clock[r]
                if k in _PAIR:
                    rk, off = _PAIR[k]
                    recv = Action(a.stage + off, rk, a.microbatch)
                    t1 = t0 + costs.task + costs.send_message
                    sent[recv] = t1
                elif k in _SENT_BY:
                    if a not in sent:
                        break
                    sk, off = _SENT_BY[k]
                    src, n = owner[a.stage + off], len(recv_ends[r])
                    p = costs.prefetch
                    posted = t0 if p == 0 else (costs.at("launch", r) if n < p else recv_ends[r][n - p])
                    boundary = min(a.stage, a.stage + off)
                    arrival = max(sent[a], posted) + costs.transfer(src, r, boundary)
                    flush[src] = max(flush[src], arrival)
                    t1 = max(t0 + costs.task, arrival) + costs.message
                    recv_ends[r].append(t1)
                    ps, mb = a.stage + off, a.microbatch
                    producer = Action(ps, Kind.F if k is Kind.RECV_F else schedule.backward_of(ps, mb), mb)
                    got[(producer, r)] = t1
                elif k in COMPUTE_KINDS:
                    ready = 0.0
                    for d in dependencies(schedule, a):
                        if owner[d.stage] == r:
                            if d not in end:
                                break
                            ready = max(ready, end[d])
                        elif (d, r) in got:
                            ready = max(ready, got[(d, r)])
                        else:
                            break
                    else:
                        t0 = max(t0, ready)
                        t1 = t0 + costs.task + costs.of(a)
                        start[a], end[a], clock[r] = t0, t1, t1
                        for part in a.flat:  # an OVERLAP's parts start and end with it
                            start[part], end[part] = t0, t1
                            if part.kind in (Kind.B, Kind.W):  # the last one before its stage's ALLREDUCE counts
                                began[part.stage] = t0 + costs.task
                        pc[r] += 1
                        remaining -= 1
                        progressed = True
                        continue
                    break
                elif k is Kind.ALLREDUCE:  # the replicas' gradient average (Note [runtime costs])
                    t1 = costs.allreduce_end(a.stage, began.get(a.stage, t0), t0 + costs.task)
                else:  # FREE, FILL: the runtime's loop still starts them
                    t1 = t0 + costs.task
                start[a], end[a], clock[r] = t0, t1, t1
                pc[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            return Timing((start, end, [], {r: acts[pc[r]] for r, acts in enumerate(orders) if pc[r] < len(acts)}))
    gather = [sum(costs.allgather(s) for s in {a.stage for a in acts if a.kind is Kind.ALLREDUCE})
              for acts in orders]  # ZeRO-1's all-gather after the optimizer step
    rank_end = [max(clock[r], flush[r]) + costs.at("optimizer", r) + gather[r] for r in range(len(orders))]
    return Timing((start, end, rank_end, {}))

