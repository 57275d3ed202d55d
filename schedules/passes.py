"""Lowering passes: compute-only schedule in, schedule with communication and frees out.

Note [deadlock-free ordering]
-----------------------------
Point-to-point sends and receives are treated as *blocking rendezvous*: a send
completes only when the peer is at the matching receive (gloo and NCCL may do so).
``add_send_recv`` makes such programs unable to deadlock by construction:

1. Simulate the compute order (unit costs unless given).  This gives one global
   timeline in which every compute action has a start and an end.
2. Every cross-rank dependency becomes a *transfer event* at the producer's end
   time.  Compute events sit at their start time.  Sort all events by time, with
   transfers before computes at equal times (a consumer starts no earlier than
   its transfer) and a fixed tie-break otherwise.
3. Each rank's program is that global sequence projected onto the rank: a
   transfer contributes ``SEND_*`` to the producer and ``RECV_*`` to the consumer.

The global sequence is itself a valid one-at-a-time execution, so the earliest
unfinished event is always runnable: a compute is next in its rank's program, and a
transfer is next in both ranks' programs.  Hence no cycle of waiting ranks can form,
and on every (sender, receiver) pair the k-th send meets the k-th receive, so
order-matched transports (NCCL, which has no tags) pair messages correctly.
``simulate_blocking`` checks this property for any lowered program.  The runtime
may send asynchronously; that only relaxes the rendezvous, so it stays deadlock-free.

``sink_receives`` then moves a receive later past computes that do not consume it (and
no further than its consumer or the rank's next send or receive).  Each rank's order of
sends and receives is unchanged, and a compute never waits on another rank except
through a receive before it, so the global sequence above still runs to the end (with
the moved computes run earlier): still deadlock-free, still order-matched.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from .actions import Action, BACKWARD_KINDS, COMM_KINDS, COMPUTE_KINDS, Kind
from .simulate import Costs, simulate

if TYPE_CHECKING:
    from .schedule import Schedule

__all__ = ["add_send_recv", "sink_receives", "add_allreduce", "add_frees", "add_fill_slots", "add_tie_reduce", "check_ties", "lower"]

_COMPUTE, _TRANSFER = 1, 0  # transfers sort before computes at equal times


def add_send_recv(schedule: Schedule, costs: Optional[Costs] = None) -> Schedule:
    """Insert matched ``SEND_*``/``RECV_*`` pairs; see Note [deadlock-free ordering]."""
    if any(a.kind in COMM_KINDS for acts in schedule.ranks for a in acts):
        raise ValueError("add_send_recv expects a compute-only schedule, but it already has send/recv actions")
    # Zero-cost actions would tie with their successors; the unit model keeps order strict.
    sim = simulate(schedule, costs if costs is not None and _all_positive(costs) else Costs())
    owner = schedule.stage_to_rank
    events: list[tuple[float, int, int, int, tuple]] = []
    for r, acts in enumerate(schedule.ranks):
        prev_end = 0.0
        for i, a in enumerate(acts):
            # Non-compute actions (ALLREDUCE, FREE) ride with the compute before them,
            # also when several of them follow one compute.
            t = sim.start.get(a, prev_end)
            prev_end = sim.end.get(a, t)
            events.append((t, _COMPUTE, r, i, (r, a)))
            # An OVERLAP's parts end with it: both parts' sends follow it, the forward's first
            # (a stable sort keeps them in this order), and every receive a part needs comes
            # before it (Note [overlapped forward and backward] in actions.py).
            for part in a.flat:
                for consumer in _consumers(schedule, part):
                    dst = owner[consumer.stage]
                    if dst != r:
                        fwd, mb = part.kind is Kind.F, part.microbatch
                        send = Action(part.stage, Kind.SEND_F if fwd else Kind.SEND_B, mb)
                        recv = Action(consumer.stage, Kind.RECV_F if fwd else Kind.RECV_B, mb)
                        events.append((sim.end[part], _TRANSFER, r, i, (r, send, dst, recv)))
    events.sort(key=lambda e: e[:4])
    ranks: list[list[Action]] = [[] for _ in schedule.ranks]
    for *_, ev in events:
        if len(ev) == 2:
            ranks[ev[0]].append(ev[1])
        else:
            src, send, dst, recv = ev
            ranks[src].append(send)
            ranks[dst].append(recv)
    return schedule.replace(ranks=tuple(map(tuple, ranks)))


def sink_receives(lowered: Schedule) -> Schedule:
    """Move each receive after the computes that follow it and do not consume it, up to
    its consumer or the next send or receive; see Note [deadlock-free ordering].

    The unit-cost timeline of ``add_send_recv`` puts a receive at its send's end, ahead of
    work its rank could do while the message travels (ZB-V: a ``W``, or the ``F`` of the
    other stage); the runtime's receive holds the rank until the message is there.
    """
    ranks = []
    for acts in lowered.ranks:
        out = list(acts)
        i = 0
        while i < len(out):
            a = out[i]
            if a.kind not in (Kind.RECV_F, Kind.RECV_B):
                i += 1
                continue
            consumer = (Action(a.stage, Kind.F, a.microbatch) if a.kind is Kind.RECV_F
                        else Action(a.stage, lowered.backward_of(a.stage, a.microbatch), a.microbatch))
            j = i
            while j + 1 < len(out) and out[j + 1].kind in COMPUTE_KINDS and consumer not in out[j + 1].flat:
                j += 1
            out[i:j + 1] = out[i + 1:j + 1] + [a]
            i = j + 1 if j > i else i + 1
        ranks.append(tuple(out))
    return lowered.replace(ranks=tuple(ranks))


def _all_positive(costs: Costs) -> bool:
    return all(v > 0 for name in ("f", "b", "w") for v in costs.values(name))


def _consumers(schedule: Schedule, a: Action) -> list[Action]:
    """Compute actions on other stages that consume what ``a`` produces."""
    s, k, m = a.stage, a.kind, a.microbatch
    if k is Kind.F and s + 1 < schedule.num_stages:
        return [Action(s + 1, Kind.F, m)]
    if k in BACKWARD_KINDS and s > 0:
        return [Action(s - 1, schedule.backward_of(s - 1, m), m)]
    return []


def add_allreduce(schedule: Schedule) -> Schedule:
    """Insert ``sALLREDUCE`` after the last backward (``B`` or ``W``) of stage s, and after
    the send of that backward's input gradient, so the previous stage never waits on it."""
    if schedule.forward_only:
        return schedule
    ranks = []
    for acts in schedule.ranks:
        last = {}
        for i, a in enumerate(acts):
            for part in a.flat:  # an OVERLAP's backward counts
                if part.kind in (Kind.B, Kind.W, Kind.SEND_B):
                    last[part.stage] = i
        out = []
        for i, a in enumerate(acts):
            out.append(a)
            out += [Action(s, Kind.ALLREDUCE) for s, j in sorted(last.items()) if j == i]
        ranks.append(tuple(out))
    return schedule.replace(ranks=tuple(ranks))


def add_frees(schedule: Schedule) -> Schedule:
    """Insert ``FREE(s, m)`` right after the last action on a rank that touches (s, m)."""
    ranks = []
    for acts in schedule.ranks:
        last: dict[tuple[int, int], int] = {}
        for i, a in flat_positions(acts):  # an OVERLAP touches both its parts' buffers
            if a.microbatch is None or a.kind is Kind.FREE:
                continue
            # A received input belongs to the receiving stage's buffers, as does a received gradient.
            last[(a.stage, a.microbatch)] = i
        frees_at: dict[int, list[Action]] = {}
        for (s, m), i in last.items():
            frees_at.setdefault(i, []).append(Action(s, Kind.FREE, m))
        out = []
        for i, a in enumerate(acts):
            out.append(a)
            out += sorted(frees_at.get(i, []))
        ranks.append(tuple(out))
    return schedule.replace(ranks=tuple(ranks))


def flat_positions(actions: Sequence[Action]):
    """``(position, action)`` of each action, an OVERLAP's parts at the OVERLAP's position."""
    return ((i, part) for i, a in enumerate(actions) for part in a.flat)


def lower(schedule: Schedule, *, allreduce: bool = False, costs: Optional[Costs] = None,
          ties: Sequence[Sequence[int]] = (), sink: bool = False) -> Schedule:
    """The full lowering: send/recv pairs (``sink``: receives moved after the work
    before their consumer, ``sink_receives``), optional DP all-reduce, frees, and a tie
    reduction per group of stages that share parameters (``ties``)."""
    lowered = add_send_recv(schedule, costs)
    if sink:
        lowered = sink_receives(lowered)
    if allreduce:
        lowered = add_allreduce(lowered)
    lowered = add_frees(lowered)
    return add_tie_reduce(lowered, ties) if ties else lowered


# Note [tie reduction]
# --------------------
# A parameter that several stages share (tied embeddings) lives as one copy per stage;
# its gradient is the sum over the copies, and every copy steps with that sum.  Each rank
# holding a stage of tie group g runs ``TIE_REDUCE g``: it sums its local copies'
# gradients and all-reduces the sum with the group's other ranks.  Collectives of
# different rank subsets must run in the same relative order on every rank, or two ranks
# could each wait in a different collective for the other; so every tie reduction goes
# at the end of its rank's program (after all the rank's backward work and sends), in
# group order: every rank follows a subsequence of one global order.  The data-parallel
# ALLREDUCE placed earlier joins replicas of one rank, which run the same program, and
# sums and means commute, so a tied gradient is the replicas' mean of the stages' sum.


def check_ties(ties: Sequence[Sequence[int]], num_stages: int) -> tuple[tuple[int, ...], ...]:
    """Tie groups as sorted tuples of two or more distinct stages in ``0..num_stages-1``."""
    out = []
    for g, group in enumerate(ties):
        stages = tuple(sorted(set(group)))
        if len(stages) < 2 or len(stages) != len(group) or not all(0 <= s < num_stages for s in stages):
            raise ValueError(f"tie group {g} {list(group)} must name two or more distinct stages of "
                             f"0..{num_stages - 1}")
        out.append(stages)
    return tuple(out)


def add_tie_reduce(lowered: Schedule, ties: Sequence[Sequence[int]]) -> Schedule:
    """Append ``<s>TIE_REDUCE<g>`` (``s``: the rank's first stage of group ``g``) to every
    rank holding a stage of tie group ``g``; see Note [tie reduction]."""
    ties = check_ties(ties, lowered.num_stages)
    ranks = []
    for r, acts in enumerate(lowered.ranks):
        out = list(acts)
        for g, group in enumerate(ties):
            mine = [s for s in group if lowered.stage_to_rank[s] == r]
            if mine:
                out.append(Action(mine[0], Kind.TIE_REDUCE, tie_group=g))
        ranks.append(tuple(out))
    return lowered.replace(ranks=tuple(ranks))


def add_fill_slots(lowered: Schedule, positions: dict[int, list[int]]) -> Schedule:
    """Insert ``FILL`` slots (PipeFill) before the given positions of each rank's program.

    ``positions[r]`` are indices into rank r's lowered program (typically the receive
    where the rank would otherwise wait).  Slot ``k`` of a rank is written
    ``<stage>FILL<k>`` with the rank's first stage.  Fill slots carry no data
    dependencies, so they never change the deadlock-freedom of the program.
    """
    ranks = []
    for r, acts in enumerate(lowered.ranks):
        where = sorted(set(positions.get(r, ())))
        bad = [i for i in where if not 0 <= i <= len(acts)]
        if bad:
            raise ValueError(f"fill position {bad[0]} is outside rank {r}'s program (0..{len(acts)})")
        stage = lowered.stages_of(r)[0] if lowered.stages_of(r) else 0
        out, k = [], 0
        for i, a in enumerate(acts):
            if k < len(where) and where[k] == i:
                out.append(Action(stage, Kind.FILL, fill_slot=k))
                k += 1
            out.append(a)
        if k < len(where):
            out.append(Action(stage, Kind.FILL, fill_slot=k))
        ranks.append(tuple(out))
    return lowered.replace(ranks=tuple(ranks))
