"""PipeFill's planning, pure (no Ray): where the bubbles are, and which chunks of which
jobs go into each of them this step.

1. **Measure** (``find_bubbles``): on profiled steps, the time a rank spends at each
   wait (a receive or the all-reduce), with the ``FILL`` slot before it, is that wait's
   bubble; a bubble is the *shortest* such time over the steps given.
2. **Plan** (``plan_fill``, every step): a policy orders the jobs; each bubble gets a
   few chunks whose predicted time fits it and whose memory fits what is free there.
3. **Account** (``collect``, ``return_unprocessed``): every input is processed exactly
   once, in order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from actors.program import Instr
from actors.protocol import ChunkResult, FillChunk, FillSlot
from schedules import WAIT_KINDS, Kind

from .job import FillJob

__all__ = ["Bubble", "POLICIES", "CHUNKS_PER_BUBBLE", "OVERPLAN", "REPROBE_AFTER", "waits_of", "find_bubbles",
           "free_per_rank", "plan_fill", "return_unprocessed", "collect", "describe"]


@dataclasses.dataclass(frozen=True)
class Bubble:
    rank: int  # pipeline rank
    position: int  # the wait's index in the rank's program without FILL slots (where its slot goes)
    seconds: float  # measured idle time there
    free_bytes: int  # free memory on the actor's device at that point


def waits_of(program: Sequence[Instr], timeline: Sequence[tuple]) -> list[tuple[int, float]]:
    """One rank's waits in one profiled step: ``(position, seconds)`` per wait (receive or
    all-reduce), the seconds including a ``FILL`` slot right before it; ``position`` is
    the wait's index in the program without FILL slots.  ``timeline`` lists the
    executed ``(index, start_ns, end_ns)``."""
    spans = {i: (t1 - t0) / 1e9 for i, t0, t1 in timeline}
    out, slots = [], 0
    for i, ins in enumerate(program):
        if ins.kind is Kind.FILL:
            slots += 1
        elif ins.kind in WAIT_KINDS:
            slot = spans.get(i - 1, 0.0) if i and program[i - 1].kind is Kind.FILL else 0.0
            out.append((i - slots, spans.get(i, 0.0) + slot))
    return out


def find_bubbles(programs: Sequence[Sequence[Instr]], timelines: Sequence[Sequence], free_bytes: Sequence[int],
                 min_bubble_s: float = 0.0, statistic: Callable[[list[float]], float] = min) -> list[Bubble]:
    """Bubbles from profiled steps: ``timelines[step][rank]`` lists a rank's executed
    ``(index, start_ns, end_ns)`` in ``programs[rank]``.

    A wait's bubble is ``statistic`` of its times over the steps (``waits_of``); by default
    the shortest, which is what PipeFill plans with: a bubble's length swings with the
    skew between the actors' step starts, and work planned into the median would overrun
    it in half the steps (the main job comes first).  ``statistics.fmean`` gives the mean
    idle time instead.  Those of at least ``min_bubble_s`` are returned, in rank and
    program order.
    """
    seen: dict[tuple[int, int], list[float]] = {}
    for step in timelines:
        for rank, program in enumerate(programs):
            for pos, seconds in waits_of(program, step[rank]):
                seen.setdefault((rank, pos), []).append(seconds)
    bubbles = [Bubble(rank, pos, statistic(times), free_bytes[rank]) for (rank, pos), times in sorted(seen.items())]
    return [b for b in bubbles if b.seconds >= min_bubble_s]


def free_per_rank(free_bytes: Sequence[int], rank_of: Callable[[int], int], num_ranks: int) -> list[int]:
    """Per pipeline rank, the least memory free on any of its actors (``free_bytes[i]`` on
    actor ``i``, of rank ``rank_of(i)``).  Every replica runs replica 0's plan, and under
    ``zero=1`` a rank's replicas hold different shares of the optimizer state (whole
    parameters balanced by bytes): the fullest replica is what a chunk must fit beside."""
    out = [None] * num_ranks
    for i, free in enumerate(free_bytes):
        r = rank_of(i)
        out[r] = free if out[r] is None else min(out[r], free)
    return [0 if f is None else int(f) for f in out]


def _fifo(jobs: list[FillJob]) -> list[FillJob]:
    return sorted(jobs, key=lambda j: j.id)


def _sjf(jobs: list[FillJob]) -> list[FillJob]:
    return sorted(jobs, key=lambda j: (j.remaining * (j.cost_per_sample or 0.0), j.remaining, j.id))


def _throughput(jobs: list[FillJob]) -> list[FillJob]:
    # Most samples per bubble-second first; unmeasured jobs get probed first.
    return sorted(jobs, key=lambda j: (j.cost_per_sample or 0.0, j.id))


POLICIES: dict[str, Callable[[list[FillJob]], list[FillJob]]] = {"fifo": _fifo, "sjf": _sjf, "throughput": _throughput}


# Note [fill budgets]: a slot carries a time budget, the bubble less the margin, and a
# few chunks more than the budget predicts (OVERPLAN).  The actor starts a chunk only
# while, by its own clock, the budget has room for it (and, where the backend can tell,
# while the receive after the slot has not arrived); chunks it does not start go back
# to the controller.  So a chunk slower than predicted costs at most itself, a faster
# one leaves no hole, and CHUNKS_PER_BUBBLE small chunks bound the overrun.
CHUNKS_PER_BUBBLE = 4
OVERPLAN = 1.5

# Note [no starving]: the cost model learns only from chunks that run, and the planner runs
# only chunks the model says fit.  A pessimistic model (the fill function's first call
# building its model, a chunk that shared the core with something else) once stopped a
# job for good: no chunk fitted, so no chunk ran, so the model never heard otherwise (the
# example filled 0 of 50,000 inputs; a longer run stalled at 28k).  Two things break the
# loop: a job that has had bubbles but no chunk run for REPROBE_AFTER plans gets a
# one-input probe, started whatever its predicted time, in the longest bubble (its time
# corrects the model; it costs the main job at most one call per REPROBE_AFTER steps);
# and the fitted overhead is at most the fastest chunk seen (``job._fit_affine``).  Each
# planned chunk's predicted time fits the slot's limit, which the actor enforces: a
# chunk predicted longer would be planned every step and never started.
REPROBE_AFTER = 4


def plan_fill(bubbles: list[Bubble], slots: dict[tuple[int, int], int], jobs: list[FillJob],
              policy: Callable[[list[FillJob]], list[FillJob]], margin: float) -> dict[int, dict[int, FillSlot]]:
    """Assign chunks to slots for one step: ``{rank: {slot: FillSlot(budget_s, (FillChunk, ...))}}``.

    ``slots`` maps ``(rank, position)`` of each bubble to its FILL slot index.  A job
    whose cost model is not fitted yet gets one probe chunk per step (Note [fill cost model]).  Chunks are handed out in input
    order, so each input goes to exactly one chunk.
    """
    plan: dict[int, dict[int, FillSlot]] = {}
    probed: set[int] = set()
    reprobes = _reprobe(bubbles, jobs, policy)
    for b in sorted(bubbles, key=lambda b: (b.position, b.rank)):
        limit = b.seconds * (1.0 - margin)  # Note [fill budgets]
        budget = limit * OVERPLAN
        piece = limit / CHUNKS_PER_BUBBLE
        chunks: list = list(reprobes.get(b, ()))
        for job in policy([j for j in jobs if j.remaining > 0]):
            # Several chunks of max_chunk inputs may share one bubble.
            # A probe goes in whatever the budget: without it the job's cost is never learnt.
            while job.remaining > 0 and ((budget > 0 and not math.isclose(budget, 0.0))
                                         or (job.probe_size() and job.id not in probed)):
                n = job.probe_size()
                if n and job.id in probed:
                    break  # one probe per step: the next step sees its time
                if n:
                    probed.add(job.id)
                else:
                    n = job.chunk_size(min(budget, limit, max(piece, 2 * job.overhead)))  # Note [no starving]
                    if not n and not any(c[0] == job.id for c in chunks):
                        n = min(1, job.chunk_size(limit))  # a bubble shorter than a piece: one input if it fits
                if job.memory_per_sample:
                    n = min(n, b.free_bytes // job.memory_per_sample)
                n = min(n, job.max_chunk)
                if n < 1:
                    break
                start, n = job.take(n)
                # A probe is started whatever its predicted time: it is how the time is learnt.
                chunks.append(FillChunk(job.id, start, n, 0.0 if job.id in probed else job.predict(n)))
                budget -= job.predict(n)
                if job.id in probed:
                    break
        if chunks:
            plan.setdefault(b.rank, {})[slots[(b.rank, b.position)]] = FillSlot(limit, tuple(chunks))
    return plan


def _reprobe(bubbles: list[Bubble], jobs: list[FillJob], policy) -> dict[Bubble, list[FillChunk]]:
    """One-input probes, in the longest bubble, for jobs no chunk of which ran for
    REPROBE_AFTER plans (Note [no starving])."""
    if not bubbles:
        return {}
    longest = max(bubbles, key=lambda b: b.seconds)
    probes: dict[Bubble, list[FillChunk]] = {}
    for job in policy([j for j in jobs if j.remaining > 0]):
        job.plans_since_run += 1
        if job.plans_since_run > REPROBE_AFTER and job.probe_size() == 0 \
                and (not job.memory_per_sample or longest.free_bytes >= job.memory_per_sample):
            start, n = job.take(1)
            probes.setdefault(longest, []).append(FillChunk(job.id, start, n, 0.0))
            job.plans_since_run = 0
    return probes


def return_unprocessed(plan: dict[int, dict[int, FillSlot]], jobs: dict[int, FillJob]) -> None:
    """A step that failed hands its chunks back (keeps exactly-once across steps)."""
    for slots in plan.values():
        for slot in slots.values():
            for chunk in slot.chunks:
                jobs[chunk.job].give_back(chunk.start, chunk.n)


def collect(results: list[ChunkResult], jobs: dict[int, FillJob]) -> list[tuple[FillJob, int]]:
    """Record the chunks' results; returns ``(job, start)`` of the outputs the actors hold."""
    held = []
    for r in sorted(results, key=lambda r: (r.job, r.start)):
        if r.skipped:
            jobs[r.job].give_back(r.start, r.n)
            continue
        jobs[r.job].record(r)
        if r.error is None:
            held.append((jobs[r.job], r.start))
    for job in jobs.values():
        job.refit()
    return held


def describe(jobs: Sequence[FillJob]) -> str:
    rows = [f"{'job':<16}{'done':>12}{'busy s':>10}{'s/sample':>12}  status"]
    for j in jobs:
        status = "failed" if j.failed() else ("done" if j.done() else "running")
        cost = f"{j.cost_per_sample:.2e}" if j.cost_per_sample else "-"
        rows.append(f"{j.name:<16}{j.processed:>6}/{j.num_inputs:<5}{j.busy_seconds:>10.3f}{cost:>12}  {status}")
    return "\n".join(rows)
