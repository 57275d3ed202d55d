"""Drives PipeFill for one ``Pipeline``: places fill slots, measures the bubbles, plans
each step's chunks and brings the outputs over.  The jobs, the planner and the policies
are in ``mpmd.pipefill``.

Note [fill slots everywhere]: the training program gets a ``FILL`` slot before every
wait (receive or all-reduce), once; an empty slot costs a dictionary lookup.  A bubble is
the shortest wait after a slot over the last few measuring steps: profiled steps that run
no fill work (the first three, then one every ``refresh_every``), so bubbles that
appear, grow or vanish are followed without recompiling, and fill work never inflates
its own measurement.  Slots with bubbles shorter than ``min_bubble_s`` get no chunks.
"""

from __future__ import annotations

from typing import Optional

import ray

from actors.fill import from_wire
from schedules import Kind

from .pipefill import (
    ON_ACTOR,
    POLICIES,
    Bubble,
    FillJob,
    collect,
    describe,
    plan_fill,
    return_unprocessed,
)

__all__ = ["FillManager"]

_FETCH_TIMEOUT_S = 30.0
_FIRST_MEASURES = 3  # measuring steps before the first fill work
_WINDOW = 5  # a bubble is the shortest of its last _WINDOW measurements
_WAITS = (Kind.RECV_F, Kind.RECV_B, Kind.ALLREDUCE)


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
        self.bubbles: list[Bubble] = []  # one per slot; positions in the program without slots
        self.slot_of: dict[tuple[int, int], int] = {}  # (rank, position) -> the slot's index there
        self._since_refresh = 0
        self.fill_seconds = 0.0
        self.filled_samples = 0
        self._unfetched: list[tuple[FillJob, int]] = []  # chunks whose outputs the actors still hold
        self._since_fetch = 0
        self._waits: dict[tuple[int, int], list[float]] = {}  # (rank, position) -> recent waits there
        self._measured = 0  # measuring steps so far
        self._pending: Optional[tuple[list, list]] = None  # (take calls, the chunks whose outputs they bring)

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
        self.bubbles, self.slot_of, self._waits, self._measured = [], {}, {}, 0

    # Note [fetching fill outputs]: outputs stay on the actor that made them.  On a fetch
    # step the controller asks each actor for them right after issuing the step's RPCs;
    # the actor packs them the moment its step ends (the result went out first), in the
    # gap before the next step reaches it, and the controller unpacks them while it waits
    # for the next step.  Neither side does it on the main job's path.
    def fetch(self) -> None:
        """Bring every output the actors hold over to the controller, now."""
        self._resolve()
        if self._unfetched:
            self._pending = (self._take_outputs(), self._unfetched)
            self._unfetched = []
            self._resolve()

    def _take_outputs(self) -> list:
        """Ask every actor for its outputs, after the calls already issued to it (the step
        channel keeps that order; Note [step channel] in actors/channel.py)."""
        return [self.pipe._dispatch.call(i, "take_fill_outputs") for i in range(len(self.pipe.actors))]

    def _resolve(self) -> None:
        """Unpack an earlier fetch.  Outputs an actor lost (it died) are handed out again."""
        if self._pending is None:
            return
        (takes, chunks), self._pending = self._pending, None
        got: dict = {}
        for take in takes:
            try:
                got.update(self.pipe._dispatch.get(take, _FETCH_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - a dead actor's outputs are run again
                pass
        for job, start in chunks:
            value = got.get((job.id, start), ON_ACTOR)
            if value is ON_ACTOR:
                job._forget(start)
            else:
                job._chunks[start] = (job._chunks[start][0], from_wire(value))

    def active(self) -> bool:
        return any(j.remaining > 0 for j in self.jobs.values())

    def step(self, inputs, targets) -> float:
        pipe = self.pipe
        if not self.slot_of:
            self._place_slots()
        # A measuring step runs no fill work: a bubble measured around fill work would include
        # the delay that work caused elsewhere, and grow on itself.
        measure = self._measured < _FIRST_MEASURES or self._since_refresh >= self.refresh_every
        plan = {} if measure else self._plan()
        fills = [plan.get(i % pipe.num_ranks, {}) for i in range(len(pipe.actors))] if plan else None
        if fills and pipe.config.dp > 1:
            fills = self._spread_over_replicas(plan)
        taking: list = []

        def while_waiting() -> None:  # Note [fetching fill outputs]
            self._resolve()
            if self._since_fetch + 1 >= self.fetch_every:
                taking.extend(self._take_outputs())

        try:
            result = pipe._run("train", inputs, targets, profile=measure, fills=fills, while_waiting=while_waiting)
        except BaseException:
            return_unprocessed(plan, self.jobs)
            raise
        pipe._step_count += 1
        self._since_refresh += 1
        self._since_fetch += 1
        results = [f for r in result["raw"] for f in r.get("fills", [])]
        self._unfetched += collect(results, self.jobs)
        if taking:
            self._pending, self._unfetched, self._since_fetch = (taking, self._unfetched), [], 0
        if not self.active():
            self.fetch()  # the last chunks: no later step to overlap with
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
            extra = self._plan()
            for rank, slots in extra.items():
                per_actor[replica * pipe.num_ranks + rank] = slots
        return per_actor

    def _plan(self) -> dict:
        usable = [b for b in self.bubbles if b.seconds >= self.min_bubble_s]
        return plan_fill(usable, self.slot_of, list(self.jobs.values()), self.policy, self.margin) if usable else {}

    def _place_slots(self) -> None:
        """Ship the training program with a FILL slot before every wait (Note [fill slots everywhere])."""
        import schedules
        from actors.program import encode_program

        from ._compile import compile_programs, segments

        pipe = self.pipe
        base = schedules.lower(pipe.schedule, allreduce=pipe.config.dp > 1)
        positions = {r: [i for i, a in enumerate(acts) if a.kind in _WAITS] for r, acts in enumerate(base.ranks)}
        progs = compile_programs(schedules.add_fill_slots(base, positions))
        calls = [a.set_program.remote("train", encode_program(progs[i % pipe.num_ranks]))
                 for i, a in enumerate(pipe.actors)]
        pipe._dispatch.wait(calls, "shipping programs with fill slots")
        pipe._programs["train"] = progs
        pipe._segments["train"] = [segments(p, pipe.config.fusion) for p in progs]
        self.slot_of = {(r, p): k for r, ps in positions.items() for k, p in enumerate(ps)}

    def _measure(self, timelines: list[list]) -> None:
        """Each slot's bubble: the shortest wait after it over the last _WINDOW measuring
        steps.  A bubble's length swings with the skew between the actors' step starts;
        the median would be overrun in half the steps, and gloo cannot tell the actor when
        the data has arrived.  (On this project's 2-core CPU bench the second-shortest
        converted ~60% of the bubble time at ~+13% step time, the shortest ~30-40% at
        ~+4-9%: the main job comes first.)"""
        pipe = self.pipe
        free = pipe._dispatch.wait([a.free_memory_bytes.remote() for a in pipe.actors[: pipe.num_ranks]],
                                   "reading free memory")
        position = {(r, k): p for (r, p), k in self.slot_of.items()}
        bubbles = []
        for rank, prog in enumerate(pipe._programs["train"]):
            spans = {i: (t1 - t0) / 1e9 for i, t0, t1 in timelines[rank]}
            for i, ins in enumerate(prog):
                if ins.kind is not Kind.FILL:
                    continue
                pos = position[(rank, ins.microbatch)]
                seen = self._waits.setdefault((rank, pos), [])
                seen[:] = (seen + [spans.get(i, 0.0) + spans.get(i + 1, 0.0)])[-_WINDOW:]
                bubbles.append(Bubble(rank, pos, min(seen), free[rank]))
        self.bubbles = bubbles
        self._since_refresh = 0
        self._measured += 1

    def summary(self) -> str:
        return describe(list(self.jobs.values()))
