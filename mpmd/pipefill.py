"""PipeFill: run independent fill jobs inside the main job's pipeline bubbles.

1. **Place**: the training program is recompiled once with a ``FILL`` slot before
   every wait (receive or all-reduce) and shipped (``schedules.add_fill_slots``).
2. **Measure**: on profiled steps a slot's bubble is its time plus the wait after it;
   slots whose bubble is shorter than ``min_bubble_s`` get nothing.
3. **Plan** (every step): a policy orders the jobs; each bubble gets a few chunks whose
   predicted time fits it and whose memory fits what is free there.  A chunk runs whole
   inside its slot, never across main-job work; the actor starts no further chunk once
   the receive the slot precedes has arrived (those go back to the controller).
4. **Account**: outputs stay on the actors until fetched; every input is processed
   exactly once, in order; a chunk that raises marks its job failed, and training goes on.

The controller side lives in ``mpmd._fill_manager``; the actor side in ``actors.fill``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

from actors.fill import unbatch
from schedules import Kind

if TYPE_CHECKING:
    from ._fill_manager import FillManager

__all__ = ["FillJob", "Bubble", "POLICIES", "find_bubbles", "plan_fill"]

ON_ACTOR = object()  # a chunk's outputs, still held by the actor that ran it


@dataclasses.dataclass(eq=False, kw_only=True)
class FillJob:
    """Independent work for the bubbles: ``fn(batch)`` over ``data``, one output per input.

    ``fn`` gets a stacked batch of inputs (``collate=True``; tensors of one shape) or the
    list of inputs (``collate=False``) and returns one output per input.  It must not
    touch the main job's parameters; it runs on an actor's device.  ``cost_per_sample``
    (seconds) and ``memory_per_sample`` (bytes) are measured when not given.
    """

    fn: Callable
    data: Sequence
    name: str = "fill"
    cost_per_sample: Optional[float] = None
    memory_per_sample: Optional[int] = None
    collate: bool = True
    max_chunk: int = 1024

    def __post_init__(self) -> None:
        if not callable(self.fn):
            raise ValueError("FillJob.fn must be callable: fn(batch) -> one output per input")
        self.data = list(self.data)
        if not self.data:
            raise ValueError(f"fill job {self.name!r} has no inputs")
        self.id = -1
        self.next = 0  # first input never handed out
        self._returned: list[tuple[int, int]] = []  # (start, n) handed out, then given back
        self._chunks: dict[int, tuple[int, object]] = {}  # start -> (n, outputs, or their object ref)
        self._filled = 0
        # Same-shape tensor inputs are stacked once; a chunk then travels as one array slice.
        self._stacked = None
        if self.collate and all(isinstance(x, torch.Tensor) for x in self.data) \
                and len({(tuple(x.shape), x.dtype) for x in self.data}) == 1 and self.data[0].dtype != torch.bfloat16:
            self._stacked = torch.stack(self.data).numpy()
        self.error: Optional[str] = None
        self.busy_seconds = 0.0
        self._declared = self.cost_per_sample is not None
        self._observed: list[tuple[int, float]] = []
        self.overhead = 0.0
        self._stale = False  # chunks recorded since the cost model was fitted
        self._manager: Optional["FillManager"] = None

    @property
    def remaining(self) -> int:
        if self.error is not None:
            return 0
        return len(self.data) - self.next + sum(n for _, n in self._returned)

    def take(self, n: int) -> tuple[int, int]:
        """Hand out up to ``n`` consecutive inputs: ``(start, count)``; given-back ranges first."""
        if self._returned:
            start, have = self._returned[0]
            count = min(n, have)
            self._returned[0:1] = [(start + count, have - count)] if count < have else []
            return start, count
        count = min(n, len(self.data) - self.next)
        self.next += count
        return self.next - count, count

    def give_back(self, start: int, n: int) -> None:
        """Inputs ``start .. start+n`` were handed out but not processed: hand them out again."""
        merged: list[tuple[int, int]] = []
        for s0, k in sorted(self._returned + [(start, n)]):  # adjacent ranges join: chunks stay large
            if merged and merged[-1][0] + merged[-1][1] == s0:
                merged[-1] = (merged[-1][0], merged[-1][1] + k)
            else:
                merged.append((s0, k))
        self._returned = merged

    def _forget(self, start: int) -> None:
        """A processed chunk whose outputs were lost (its actor died before they were fetched)."""
        n, _ = self._chunks.pop(start)
        self._filled -= n
        self.give_back(start, n)

    @property
    def processed(self) -> int:
        """Inputs processed so far (their outputs may still be on the actors)."""
        return self._filled

    def done(self) -> bool:
        """Every input processed (or the job failed)."""
        return self.error is not None or self._filled == len(self.data)

    def failed(self) -> bool:
        return self.error is not None

    def results(self) -> list:
        """Outputs in input order; raises if the job failed or is not done."""
        if self._manager is not None:
            self._manager.fetch()
        if self.error is not None:
            raise RuntimeError(f"fill job {self.name!r} failed:\n{self.error}")
        if not self.done():
            raise RuntimeError(f"fill job {self.name!r} is not done: {self._filled}/{len(self.data)} inputs processed")
        # Per-input outputs are cut from the returned batches only now, off the training path.
        return [out for start in sorted(self._chunks) for out in unbatch(self._chunks[start][1], self._chunks[start][0])]

    def shipment(self):
        """Every input, as shipped once to the actors: one stacked array when collating
        same-shape tensors (chunks are slices of it), else the list."""
        return self._stacked if self._stacked is not None else self.data

    def _record(self, result: dict) -> None:
        self.busy_seconds += result["seconds"]
        if result["error"] is not None:
            self.error = self.error or result["error"]
            return
        start, n = result["start"], result["n"]
        if start in self._chunks:
            raise AssertionError(f"fill inputs from {start} of {self.name!r} processed twice")
        self._chunks[start] = (n, ON_ACTOR)
        self._filled += n
        self._observed = (self._observed + [(result["n"], result["seconds"])])[-32:]
        self._stale = True

    def refit(self) -> None:
        """Refit the cost model to the chunks seen (once per step, after recording them)."""
        if self._stale:
            self.overhead, self.cost_per_sample = _fit_affine(self._observed, self.cost_per_sample)
            self._stale = False

    # Note [fill cost model]: a chunk of n inputs takes overhead + n * cost_per_sample
    # (a call has a fixed cost besides the per-input work), fitted to the observed chunks;
    # until two chunk sizes were seen, chunks of PROBE sizes measure it.
    PROBES = (1, 8)

    def probe_size(self) -> int:
        """Size of the next probe chunk, or 0 once the cost model is fitted."""
        if self.cost_per_sample is not None and (self._declared or len({n for n, _ in self._observed}) > 1):
            return 0
        seen = {n for n, _ in self._observed}
        return next((n for n in self.PROBES if n not in seen), 0)

    def chunk_size(self, budget_s: float) -> int:
        """The most inputs whose predicted time fits ``budget_s``."""
        if not self.cost_per_sample:
            return self.max_chunk
        return max(0, int((budget_s - self.overhead) / self.cost_per_sample))

    def predict(self, n: int) -> float:
        return self.overhead + n * (self.cost_per_sample or 0.0)


def _fit_affine(observed: list[tuple[int, float]], fallback: Optional[float]) -> tuple[float, Optional[float]]:
    """``seconds = overhead + n * per_sample`` (both >= 0), fitted robustly (Theil-Sen:
    the median of pairwise slopes, then the median intercept): a chunk slowed by
    something else on the machine must not swing the model."""
    ns = {n for n, _ in observed}
    if len(ns) < 2:
        n, sec = observed[-1]
        return 0.0, (sec / max(n, 1)) if fallback is None else fallback
    slopes = [(t1 - t0) / (n1 - n0) for i, (n0, t0) in enumerate(observed) for n1, t1 in observed[i + 1:] if n1 != n0]
    slope = max(median(slopes), 1e-9)
    return max(0.0, median([t - slope * n for n, t in observed])), slope


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


@dataclasses.dataclass(frozen=True)
class Bubble:
    rank: int  # pipeline rank
    position: int  # index in the rank's program before which the FILL slot goes
    seconds: float  # measured idle time there
    free_bytes: int  # free memory on the actor's device at that point


def find_bubbles(programs: list, timelines: list[list], free_bytes: list[int], min_bubble_s: float) -> list[Bubble]:
    """Bubbles from profiled steps: ``timelines[step][rank]`` lists ``(index, t0_ns, t1_ns)``.

    A bubble is a wait (receive or all-reduce, including a FILL slot already before it)
    whose mean duration over the steps is at least ``min_bubble_s``.
    """
    waits = (Kind.RECV_F, Kind.RECV_B, Kind.ALLREDUCE)
    found = []
    for rank, prog in enumerate(programs):
        totals: dict[int, float] = {}
        for step in timelines:
            spans = {i: (t1 - t0) / 1e9 for i, t0, t1 in step[rank]}
            for i, ins in enumerate(prog):
                if ins.kind in waits:
                    before = i - 1 if i and prog[i - 1].kind is Kind.FILL else i
                    wait = spans.get(i, 0.0) + (spans.get(before, 0.0) if before != i else 0.0)
                    totals[before] = totals.get(before, 0.0) + wait
        for pos, total in sorted(totals.items()):
            mean = total / max(len(timelines), 1)
            if mean >= min_bubble_s:
                found.append(Bubble(rank, pos, mean, free_bytes[rank]))
    return found


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


def plan_fill(bubbles: list[Bubble], slots: dict[tuple[int, int], int], jobs: list[FillJob],
              policy: Callable[[list[FillJob]], list[FillJob]], margin: float) -> dict[int, dict[int, list]]:
    """Assign chunks to slots for one step: ``{rank: {slot: (budget_s, [(job_id, start, n, predicted_s), ...])}}``.

    ``slots`` maps ``(rank, position)`` of each bubble to its FILL slot index.  A job
    whose cost model is not fitted yet gets one probe chunk per step (Note [fill cost model]).  Chunks are handed out in input
    order, so each input goes to exactly one chunk.
    """
    plan: dict[int, dict[int, list]] = {}
    probed: set[int] = set()
    for b in sorted(bubbles, key=lambda b: (b.position, b.rank)):
        limit = b.seconds * (1.0 - margin)  # Note [fill budgets]
        budget = limit * OVERPLAN
        piece = limit / CHUNKS_PER_BUBBLE
        chunks: list = []
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
                    n = job.chunk_size(min(budget, max(piece, 2 * job.overhead)))
                    if not n and not any(c[0] == job.id for c in chunks):
                        n = min(1, job.chunk_size(limit))  # a bubble shorter than a piece: one input if it fits
                if job.memory_per_sample:
                    n = min(n, b.free_bytes // job.memory_per_sample)
                n = min(n, job.max_chunk)
                if n < 1:
                    break
                start, n = job.take(n)
                # A probe is started whatever its predicted time: it is how the time is learnt.
                chunks.append((job.id, start, n, 0.0 if job.id in probed else job.predict(n)))
                budget -= job.predict(n)
                if job.id in probed:
                    break
        if chunks:
            plan.setdefault(b.rank, {})[slots[(b.rank, b.position)]] = (limit, chunks)
    return plan


def return_unprocessed(plan: dict[int, dict[int, list]], jobs: dict[int, FillJob]) -> None:
    """A step that failed hands its chunks back (keeps exactly-once across steps)."""
    for slots in plan.values():
        for _, chunks in slots.values():
            for job_id, start, n, _ in chunks:
                jobs[job_id].give_back(start, n)


def collect(results: list[dict], jobs: dict[int, FillJob]) -> list[tuple[FillJob, int]]:
    """Record the chunks' results; returns ``(job, start)`` of outputs still in the object store."""
    stored = []
    for r in sorted(results, key=lambda r: (r["job"], r["start"])):
        if r.get("skipped"):
            jobs[r["job"]].give_back(r["start"], r["n"])
            continue
        jobs[r["job"]]._record(r)
        if r["error"] is None:
            stored.append((jobs[r["job"]], r["start"]))
    for job in jobs.values():
        job.refit()
    return stored


def describe(jobs: Sequence[FillJob]) -> str:
    rows = [f"{'job':<16}{'done':>12}{'busy s':>10}{'s/sample':>12}  status"]
    for j in jobs:
        status = "failed" if j.failed() else ("done" if j.done() else "running")
        cost = f"{j.cost_per_sample:.2e}" if j.cost_per_sample else "-"
        rows.append(f"{j.name:<16}{j._filled:>6}/{len(j.data):<5}{j.busy_seconds:>10.3f}{cost:>12}  {status}")
    return "\n".join(rows)
