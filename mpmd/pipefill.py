"""PipeFill: run independent fill jobs inside the main job's pipeline bubbles.

1. **Measure**: a profiled step gives each actor's waits (receives and all-reduces);
   a wait longer than ``min_bubble_s`` is a bubble at that program position.
2. **Place**: the training program is recompiled with a ``FILL`` slot before each
   bubble (``schedules.add_fill_slots``) and shipped once.
3. **Plan** (every step): a policy orders the jobs; each slot gets chunks whose
   predicted time fits the bubble (minus a safety margin) and whose memory fits
   what is free there.  A chunk runs whole inside its slot, never across main-job work.
4. **Account**: outputs come back with the step; every input is processed exactly
   once, in order; a chunk that raises marks its job failed, and training goes on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional, Sequence

import ray
import torch

from actors.fill import from_wire, unbatch
from schedules import Kind

__all__ = ["FillJob", "Bubble", "POLICIES", "FillManager", "find_bubbles", "plan_fill"]

_FETCH_TIMEOUT_S = 30.0
_ON_ACTOR = object()  # a chunk's outputs, still held by the actor that ran it


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
        self._returned = sorted(self._returned + [(start, n)])

    def _forget(self, start: int) -> None:
        """A processed chunk whose outputs were lost (its actor died before they were fetched)."""
        n, _ = self._chunks.pop(start)
        self._filled -= n
        self.give_back(start, n)

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
        self._chunks[start] = (n, _ON_ACTOR)
        self._filled += n
        self._observed = (self._observed + [(result["n"], result["seconds"])])[-32:]
        self.overhead, self.cost_per_sample = _fit_affine(self._observed, self.cost_per_sample)

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
    """Least-squares ``seconds = overhead + n * per_sample`` (both >= 0)."""
    ns = {n for n, _ in observed}
    if len(ns) < 2:
        n, sec = observed[-1]
        return 0.0, (sec / max(n, 1)) if fallback is None else fallback
    k = len(observed)
    mean_n = sum(n for n, _ in observed) / k
    mean_s = sum(t for _, t in observed) / k
    var = sum((n - mean_n) ** 2 for n, _ in observed)
    slope = sum((n - mean_n) * (t - mean_s) for n, t in observed) / var
    slope = max(slope, 1e-9)
    return max(0.0, mean_s - slope * mean_n), slope


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


# A bubble is planned as several chunks: the actor stops starting chunks once the wait
# after the slot is over, so a bubble that came out shorter than measured is overrun by
# at most one chunk (and the chunks not run are handed out again).
CHUNKS_PER_BUBBLE = 4


def plan_fill(bubbles: list[Bubble], slots: dict[tuple[int, int], int], jobs: list[FillJob],
              policy: Callable[[list[FillJob]], list[FillJob]], margin: float) -> dict[int, dict[int, list]]:
    """Assign chunks to slots for one step: ``{rank: {slot: [(job_id, start, samples), ...]}}``.

    ``slots`` maps ``(rank, position)`` of each bubble to its FILL slot index.  A job
    whose cost model is not fitted yet gets one probe chunk per step (Note [fill cost model]).  Chunks are handed out in input
    order, so each input goes to exactly one chunk.
    """
    plan: dict[int, dict[int, list]] = {}
    probed: set[int] = set()
    for b in sorted(bubbles, key=lambda b: (b.position, b.rank)):
        budget = b.seconds * (1.0 - margin)
        piece = budget / CHUNKS_PER_BUBBLE
        chunks = plan.setdefault(b.rank, {}).setdefault(slots[(b.rank, b.position)], [])
        for job in policy([j for j in jobs if j.remaining > 0]):
            # Several chunks of max_chunk inputs may share one bubble.
            while budget > 0 and not math.isclose(budget, 0.0) and job.remaining > 0:
                n = job.probe_size()
                if n and job.id in probed:
                    break  # one probe per step: the next step sees its time
                if n:
                    probed.add(job.id)
                else:
                    n = job.chunk_size(min(budget, max(piece, 2 * job.overhead))) or min(1, job.chunk_size(budget))
                if job.memory_per_sample:
                    n = min(n, b.free_bytes // job.memory_per_sample)
                n = min(n, job.max_chunk)
                if n < 1:
                    break
                start, n = job.take(n)
                chunks.append((job.id, start, n))
                budget -= job.predict(n)
                if job.id in probed:
                    break
        if not chunks:
            del plan[b.rank][slots[(b.rank, b.position)]]
            if not plan[b.rank]:
                del plan[b.rank]
    return plan


def return_unprocessed(plan: dict[int, dict[int, list]], jobs: dict[int, FillJob]) -> None:
    """A step that failed hands its chunks back (keeps exactly-once across steps)."""
    for slots in plan.values():
        for chunks in slots.values():
            for job_id, start, n in chunks:
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
    return stored


def describe(jobs: Sequence[FillJob]) -> str:
    rows = [f"{'job':<16}{'done':>12}{'busy s':>10}{'s/sample':>12}  status"]
    for j in jobs:
        status = "failed" if j.failed() else ("done" if j.done() else "running")
        cost = f"{j.cost_per_sample:.2e}" if j.cost_per_sample else "-"
        rows.append(f"{j.name:<16}{j._filled:>6}/{len(j.data):<5}{j.busy_seconds:>10.3f}{cost:>12}  {status}")
    return "\n".join(rows)




class FillManager:
    """Drives PipeFill for one ``Pipeline``: measures bubbles, places slots, plans chunks."""

    def __init__(self, pipe, *, policy, margin: float, min_bubble_s: float, refresh_every: int,
                 fetch_every: int) -> None:
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"unknown fill policy {policy!r}; use one of {', '.join(POLICIES)} or a function")
            policy = POLICIES[policy]
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        self.pipe, self.policy, self.margin = pipe, policy, margin
        self.min_bubble_s, self.refresh_every = min_bubble_s, refresh_every
        if fetch_every < 1:
            raise ValueError(f"fetch_every must be at least 1 step, got {fetch_every}")
        self.fetch_every = fetch_every
        self.jobs: dict[int, FillJob] = {}
        self.bubbles: Optional[list[Bubble]] = None  # per pipeline rank, positions in the base program
        self.slot_of: dict[tuple[int, int], int] = {}
        self._since_refresh = 0
        self.fill_seconds = 0.0
        self.filled_samples = 0
        self._unfetched: list[tuple[FillJob, int]] = []  # chunks whose outputs the actors still hold
        self._since_fetch = 0

    def add(self, job: FillJob) -> FillJob:
        if not isinstance(job, FillJob):
            raise ValueError("add_fill_job takes an mpmd.FillJob(fn, data, ...)")
        if job.id >= 0:
            raise ValueError(f"fill job {job.name!r} was already added to a pipeline")
        job.id = len(self.jobs)
        job._data_ref = ray.put(job.shipment())  # shipped once; a chunk is then (job, start, n)
        self._register([job])
        job._manager = self
        self.jobs[job.id] = job
        return job

    def _register(self, jobs: list[FillJob]) -> None:
        self.pipe._dispatch.wait([a.register_fill_job.remote(j.id, j.fn, j.collate, j._data_ref)
                                  for a in self.pipe.actors for j in jobs], "registering fill jobs")

    def reattach(self) -> None:
        """Fresh actors after a restart: register the jobs again and re-measure the bubbles."""
        self.fetch()  # outputs the dead actors held are lost: their inputs run again
        self._register(list(self.jobs.values()))
        self.bubbles, self.slot_of = None, {}

    def fetch(self, takes: Optional[list] = None) -> None:
        """Bring the outputs the actors hold over to the controller.  ``takes``: the actors'
        ``take_fill_outputs`` calls, when already issued.  Outputs an actor lost (it died)
        are handed out again."""
        if not self._unfetched:
            return
        if takes is None:
            takes = [a.take_fill_outputs.remote() for a in self.pipe.actors]
        got: dict = {}
        for take in takes:
            try:
                got.update(ray.get(take, timeout=_FETCH_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - a dead actor's outputs are run again
                pass
        pending, self._unfetched = self._unfetched, []
        for job, start in pending:
            value = got.get((job.id, start), _ON_ACTOR)
            if value is _ON_ACTOR:
                job._forget(start)
            else:
                job._chunks[start] = (job._chunks[start][0], from_wire(value))

    def active(self) -> bool:
        return any(j.remaining > 0 for j in self.jobs.values())

    def step(self, inputs, targets) -> float:
        pipe = self.pipe
        measure = self.bubbles is None or self._since_refresh >= self.refresh_every
        plan = {} if self.bubbles is None else plan_fill(self.bubbles, self.slot_of, list(self.jobs.values()),
                                                         self.policy, self.margin)
        fills = [plan.get(i % pipe.num_ranks, {}) for i in range(len(pipe.actors))] if plan else None
        if fills and pipe.config.dp > 1:
            fills = self._spread_over_replicas(plan)
        # Every fetch_every steps the outputs come over: asked for right after the step's
        # RPCs, so each actor packs them the moment its step ends.
        takes: list = []
        fetch = self._since_fetch + 1 >= self.fetch_every
        issue = (lambda: takes.extend(a.take_fill_outputs.remote() for a in pipe.actors)) if fetch else None
        try:
            result = pipe._run("train", inputs, targets, profile=measure, fills=fills, while_waiting=issue)
        except BaseException:
            return_unprocessed(plan, self.jobs)
            raise
        pipe._step_count += 1
        self._since_refresh += 1
        self._since_fetch += 1
        results = [f for r in result["raw"] for f in r.get("fills", [])]
        self._unfetched += collect(results, self.jobs)
        if fetch or not self.active():
            self.fetch(takes or None)
            self._since_fetch = 0
        self.fill_seconds += sum(f["seconds"] for f in results)
        self.filled_samples += sum(f["n"] for f in results if f["error"] is None and not f.get("skipped"))
        if measure:
            self._measure([r["timeline"] for r in result["raw"][: pipe.num_ranks]])
        return result["loss"]

    def _spread_over_replicas(self, plan: dict) -> list[dict]:
        # Each replica has the same bubbles; the plan above filled replica 0's.  Hand the
        # same slots to the other replicas with fresh chunks so every input runs once.
        pipe = self.pipe
        per_actor = [plan.get(i, {}) if i < pipe.num_ranks else {} for i in range(len(pipe.actors))]
        for replica in range(1, pipe.config.dp):
            extra = plan_fill(self.bubbles, self.slot_of, list(self.jobs.values()), self.policy, self.margin)
            for rank, slots in extra.items():
                per_actor[replica * pipe.num_ranks + rank] = slots
        return per_actor

    def _measure(self, timelines: list[list]) -> None:
        pipe = self.pipe
        programs = pipe._programs["train"]
        free = pipe._dispatch.wait([a.free_memory_bytes.remote() for a in pipe.actors[: pipe.num_ranks]],
                                   "reading free memory")
        if self.bubbles is None:
            self.bubbles = find_bubbles(programs, [timelines], free, self.min_bubble_s)
            self._place_slots()
        else:
            self.bubbles = self._remeasure(programs, timelines, free)
        self._since_refresh = 0

    def _place_slots(self) -> None:
        import schedules
        from actors.program import encode_program

        from ._compile import compile_programs, segments

        pipe = self.pipe
        positions: dict[int, list[int]] = {}
        for b in self.bubbles:
            positions.setdefault(b.rank, []).append(b.position)
        self.slot_of = {(r, p): k for r, ps in positions.items() for k, p in enumerate(sorted(ps))}
        base = schedules.lower(pipe.schedule, allreduce=pipe.config.dp > 1)
        progs = compile_programs(schedules.add_fill_slots(base, positions))
        calls = [a.set_program.remote("train", encode_program(progs[i % pipe.num_ranks]))
                 for i, a in enumerate(pipe.actors)]
        pipe._dispatch.wait(calls, "shipping programs with fill slots")
        pipe._programs["train"] = progs
        pipe._segments["train"] = [segments(p, pipe.config.fusion) for p in progs]

    def _remeasure(self, programs: list, timelines: list[list], free: list[int]) -> list[Bubble]:
        # With slots in place a bubble is the FILL slot's time plus the wait after it.
        by_slot = {(b.rank, self.slot_of[(b.rank, b.position)]): b for b in self.bubbles}
        updated = []
        for rank, prog in enumerate(programs):
            spans = {i: (t1 - t0) / 1e9 for i, t0, t1 in timelines[rank]}
            for i, ins in enumerate(prog):
                if ins.kind is Kind.FILL and (rank, ins.microbatch) in by_slot:
                    old = by_slot[(rank, ins.microbatch)]
                    seconds = spans.get(i, 0.0) + spans.get(i + 1, 0.0)
                    updated.append(dataclasses.replace(old, seconds=0.5 * old.seconds + 0.5 * seconds,
                                                       free_bytes=free[rank]))
        return updated

    def summary(self) -> str:
        return describe(list(self.jobs.values()))
