"""Compile a lowered schedule into one program per pipeline rank (buffer ids fixed)."""

from __future__ import annotations

import heapq

import schedules
from actors.program import Instr
from schedules import WAIT_KINDS, Kind, Schedule

__all__ = ["compile_programs", "segments", "forward_only", "lower_for_training", "pipeline_programs", "TRAIN",
           "FORWARD"]

TRAIN, FORWARD = "train", "forward"  # the programs every pipeline ships

_PEER_STEP = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}


def forward_only(schedule: Schedule) -> Schedule:
    """The schedule's forwards in the same per-rank order (predict / evaluate)."""
    ranks = tuple(tuple(a for a in schedules.flat(acts) if a.kind is Kind.F) for acts in schedule.ranks)  # an OVERLAP's F too
    return schedule.replace(ranks=ranks, forward_only=True, name=schedule.name + "/forward")


def lower_for_training(schedule: Schedule, dp: int = 1, ties=()) -> Schedule:
    """The training schedule lowered as the engine runs it: sends and receives, each receive
    after the work its rank can do before the consumer (``schedules.sink_receives``: the
    rank computes while the message travels), the data-parallel all-reduce with ``dp > 1``,
    frees, and a tie reduction per group of stages in ``ties``."""
    return schedules.lower(schedule, allreduce=dp > 1, ties=ties, sink=True)


def pipeline_programs(schedule: Schedule, dp: int = 1, ties=()) -> dict[str, list[list[Instr]]]:
    """The programs every pipeline ships, per rank: ``TRAIN`` (``lower_for_training``) and
    ``FORWARD`` (the forwards alone, for predict and evaluate)."""
    return {TRAIN: compile_programs(lower_for_training(schedule, dp, ties)),
            FORWARD: compile_programs(schedules.lower(forward_only(schedule)))}


def compile_programs(lowered: Schedule) -> list[list[Instr]]:
    return [_compile_rank(lowered, r) for r in range(lowered.num_ranks)]


def _compile_rank(lowered: Schedule, rank: int) -> list[Instr]:
    owner = lowered.stage_to_rank
    slots: dict[tuple[int, int], int] = {}
    free: list[int] = []
    next_id = 0

    def slot(stage: int, mb: int) -> int:
        nonlocal next_id
        key = (stage, mb)
        if key not in slots:
            if free:
                slots[key] = heapq.heappop(free)
            else:
                slots[key], next_id = next_id, next_id + 1
        return slots[key]

    def compute(a) -> Instr:
        s, k, m = a.stage, a.kind, a.microbatch
        buf = slot(s, m)
        peer = owner[s + _PEER_STEP[k]] if k in _PEER_STEP else -1
        aux = -1
        # A neighbouring stage on this same rank gets the result handed over in memory.
        if k is Kind.F and s + 1 < lowered.num_stages and owner[s + 1] == rank:
            aux = slot(s + 1, m)
        elif k in (Kind.B, Kind.I) and s > 0 and owner[s - 1] == rank:
            aux = slot(s - 1, m)
        return Instr(k, s, m, buf, peer, aux)

    out: list[Instr] = []
    for a in lowered.ranks[rank]:
        s, k, m = a.stage, a.kind, a.microbatch
        if k is Kind.OVERLAP:  # one instruction, its parts' buffers as they would have alone
            out.append(Instr(k, s, -1, parts=tuple(compute(p) for p in a.parts)))
            continue
        if k is Kind.ALLREDUCE:
            out.append(Instr(k, s, -1))
            continue
        if k is Kind.FILL:
            out.append(Instr(k, s, -1, fill_slot=a.fill_slot))
            continue
        if k is Kind.TIE_REDUCE:
            out.append(Instr(k, s, -1, tie_group=a.tie_group))
            continue
        if k is Kind.FREE:
            if (s, m) in slots:
                buf = slots.pop((s, m))
                heapq.heappush(free, buf)
                out.append(Instr(k, s, m, buf))
            continue
        out.append(compute(a))
    return out


def segments(program: list[Instr], fusion: str) -> list[tuple[int, int]]:
    """RPC boundaries: the whole program ("step"), runs of work between communication
    waits ("consecutive"), or one instruction each ("none")."""
    n = len(program)
    if fusion == "step" or n == 0:
        return [(0, n)]
    if fusion == "none":
        return [(i, i + 1) for i in range(n)]
    cuts = [0] + [i for i, ins in enumerate(program) if ins.kind in WAIT_KINDS and i > 0] + [n]
    return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
