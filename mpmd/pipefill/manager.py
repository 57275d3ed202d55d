"""Drives PipeFill for one pipeline: places fill slots, measures the bubbles, plans each
step's chunks and brings the outputs over.  The jobs are in ``job.py``, the planner and
the policies in ``planner.py``, the actor side in ``actors/fill.py``.

Note [fill slots everywhere]: the training program gets a ``FILL`` slot before every
wait (receive or all-reduce), once; an empty slot costs a dictionary lookup.  A bubble is
the shortest wait after a slot over the last few measuring steps (``find_bubbles``):
profiled steps that run no fill work (the first three, then one every
``refresh_every``), so bubbles that appear, grow or vanish are followed without
recompiling, and fill work never inflates its own measurement.  Slots with bubbles
shorter than ``min_bubble_s`` get no chunks.  (On this project's 2-core CPU bench the
second-shortest wait converted ~60% of the bubble time at ~+13% step time, the shortest
~30-40% at ~+4-9%: the main job comes first.)
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional, Union

import ray

import schedules
from actors.fill import from_wire
from schedules import WAIT_KINDS, Kind

from ..runtime import TRAIN, Engine, StepResult
from .job import ON_ACTOR, FillJob
from .planner import (POLICIES, Bubble, collect, describe, find_bubbles, free_per_rank, plan_fill,
                      return_unprocessed)

__all__ = ["FillManager"]

_FETCH_TIMEOUT_S = 30.0
_FIRST_MEASURES = 3  # measuring steps before the first fill work
_WINDOW = 5  # a bubble is the shortest of its last _WINDOW measurements


class FillManager:
    """Runs ``FillJob``s in the bubbles of ``engine``'s training steps (``Pipeline.add_fill_job``)."""

    def __init__(self, engine: Engine, *, policy: Union[str, Callable], margin: float, min_bubble_s: float,
                 refresh_every: int, fetch_every: int) -> None:
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"unknown fill policy {policy!r}; use one of {', '.join(POLICIES)} or a function")
            policy = POLICIES[policy]
        if not 0.0 <= margin < 1.0:
            raise ValueError(f"margin must be in [0, 1), got {margin}")
        if fetch_every < 1:
            raise ValueError(f"fetch_every must be at least 1 step, got {fetch_every}")
        if engine.config.layout.tp > 1:
            raise ValueError("PipeFill (add_fill_job) is not supported with tp > 1 yet: a fill job would run on one "
                             "actor of a TP group while its peers wait in the stage's collectives; use tp=1")
        self.engine, self.policy, self.margin = engine, policy, margin
        self.min_bubble_s, self.refresh_every, self.fetch_every = min_bubble_s, refresh_every, fetch_every
        self.jobs: dict[int, FillJob] = {}
        self.bubbles: list[Bubble] = []
        self.slot_of: dict[tuple[int, int], int] = {}  # (rank, position of a wait) -> its FILL slot's index
        self.fill_seconds = 0.0  # actor seconds spent in fill chunks
        self.filled_samples = 0  # inputs processed
        self.lost_samples = 0  # of them, inputs whose outputs were lost before a fetch (they ran again)
        self.fill_steps = 0  # steps that ran with fill work planned
        self._data_refs: dict[int, Any] = {}  # job id -> its inputs in Ray's object store
        self._recent: collections.deque = collections.deque(maxlen=_WINDOW)  # measuring steps' timelines
        self._measured = 0  # measuring steps so far
        self._since_refresh = 0
        self._unfetched: list[tuple[FillJob, int]] = []  # chunks whose outputs the actors still hold
        self._since_fetch = 0
        self._pending: Optional[tuple[list, list]] = None  # (take calls, the chunks whose outputs they bring)
        engine.fleet.on_restart(self.reattach)

    def add(self, job: FillJob) -> FillJob:
        if not isinstance(job, FillJob):
            raise ValueError("add_fill_job takes an mpmd.FillJob(fn, data, ...)")
        job.attach(len(self.jobs), self.fetch)
        self._data_refs[job.id] = ray.put(job.shipment())  # shipped once; a chunk is then (job, start, n)
        self._register([job])
        self.jobs[job.id] = job
        return job

    def _register(self, jobs: list[FillJob]) -> None:
        for j in jobs:
            self.engine.client.register_fill_job(j.id, j.fn, j.collate, self._data_refs[j.id])

    def reattach(self) -> None:
        """Fresh actors after a restart: register the jobs again and re-measure the bubbles."""
        self.fetch()  # outputs the dead actors held are lost: their inputs run again
        self._register([j for j in self.jobs.values() if j.id in self._data_refs])  # not the released
        self.bubbles, self.slot_of, self._measured = [], {}, 0
        self._recent.clear()

    def active(self) -> bool:
        return any(j.remaining > 0 for j in self.jobs.values())

    # Note [fetching fill outputs]: outputs stay on the actor that made them.  On a fetch
    # step the controller asks each actor for them right after issuing the step's calls;
    # the actor packs them the moment its step ends (the result went out first), in the
    # gap before the next step reaches it, and the controller unpacks them while it waits
    # for the next step.  Neither side does it on the main job's path.
    def fetch(self) -> None:
        """Bring every output the actors hold over to the controller, now; then release the
        finished jobs' inputs (Note [finished fill jobs])."""
        self._resolve()
        if self._unfetched and not self.engine.fleet.closed:
            self._pending = (self._take_outputs(), self._unfetched)
            self._unfetched = []
            self._resolve()
        self._release_finished()

    # Note [finished fill jobs]: a job's inputs live in three places while it runs: the job,
    # Ray's object store (shipped once) and every actor.  Once it is done (or failed) and every
    # output is on the controller, none of them is needed again (a restart registers only the
    # jobs still running), so all three go: a pipeline that runs job after job for weeks holds
    # the inputs of the jobs running, not of every job it ever ran.  Only ``fetch`` releases,
    # never ``_resolve``, which also runs while a step is in flight.
    def _release_finished(self) -> None:
        finished = [j for j in self.jobs.values() if j.id in self._data_refs and j.done() and j.outputs_here()]
        if not finished:
            return
        for job in finished:
            del self._data_refs[job.id]
            job.release()
        if not self.engine.fleet.closed:
            self.engine.client.drop_fill_jobs([j.id for j in finished])

    def _take_outputs(self) -> list:
        """Ask every actor for its outputs, after the calls already issued to it (the step
        channel keeps that order; Note [step channel] in actors/channel.py)."""
        return self.engine.client.take_fill_outputs()

    def _resolve(self) -> None:
        """Unpack an earlier fetch.  Outputs an actor lost (it died) are handed out again."""
        if self._pending is None:
            return
        (takes, chunks), self._pending = self._pending, None
        got: dict = {}
        for take in takes:
            try:
                got.update(self.engine.client.result_of(take, _FETCH_TIMEOUT_S))
            except Exception:  # noqa: BLE001 - a dead actor's outputs are run again
                pass
        for job, start in chunks:
            value = got.get((job.id, start), ON_ACTOR)
            if value is ON_ACTOR:
                self.lost_samples += job.lose(start)
            else:
                job.store(start, from_wire(value))

    def step(self, inputs: Any, targets: Any, side: Optional[dict] = None) -> StepResult:
        """One training step with fill work in its bubbles (or a measuring step)."""
        engine = self.engine
        self._release_finished()  # a job that ended while others run (Note [finished fill jobs])
        if not self.slot_of:
            self._place_slots()
        # A measuring step runs no fill work: a bubble measured around fill work would include
        # the delay that work caused elsewhere, and grow on itself.
        measure = self._measured < _FIRST_MEASURES or self._since_refresh >= self.refresh_every
        plan = {} if measure else self._plan()
        fills = self._per_actor(plan) if plan else None
        taking: list = []

        def while_waiting() -> None:  # Note [fetching fill outputs]
            self._resolve()
            if self._since_fetch + 1 >= self.fetch_every:
                taking.extend(self._take_outputs())

        try:
            result = engine.train_step(inputs, targets, side=side, profile=measure, fills=fills,
                                       while_waiting=while_waiting)
        except BaseException:
            return_unprocessed(plan, self.jobs)
            raise
        self._since_refresh += 1
        self._since_fetch += 1
        chunks = result.fill_results
        self._unfetched += collect(chunks, self.jobs)
        if taking:
            self._pending, self._unfetched, self._since_fetch = (taking, self._unfetched), [], 0
        if not self.active():
            self.fetch()  # the last chunks: no later step to overlap with
        self.fill_steps += bool(plan)
        self.fill_seconds += sum(c.seconds for c in chunks)
        self.filled_samples += sum(c.n for c in chunks if c.error is None and not c.skipped)
        if measure:
            self._measure(result.timelines[: engine.num_ranks])
        return result

    def _per_actor(self, plan: dict) -> list[dict]:
        # Each replica has the same bubbles; the plan filled replica 0's.  Hand the same
        # slots to the other replicas with fresh chunks so every input runs once.
        engine = self.engine
        per_actor = [plan.get(i, {}) if i < engine.num_ranks else {} for i in range(engine.num_actors)]
        for replica in range(1, engine.config.layout.dp):
            for rank, slots in self._plan().items():
                per_actor[replica * engine.num_ranks + rank] = slots
        return per_actor

    def _plan(self) -> dict:
        usable = [b for b in self.bubbles if b.seconds >= self.min_bubble_s]
        return plan_fill(usable, self.slot_of, list(self.jobs.values()), self.policy, self.margin) if usable else {}

    def _place_slots(self) -> None:
        """Ship the training program with a FILL slot before every wait (Note [fill slots everywhere])."""
        engine = self.engine
        base = engine.lower_train()
        positions = {r: [i for i, a in enumerate(acts) if a.kind in WAIT_KINDS] for r, acts in enumerate(base.ranks)}
        filled = schedules.add_fill_slots(base, positions)
        engine.install_program(TRAIN, filled)
        # Each FILL names its slot; the k-th FILL of a rank, at index i, precedes the wait at
        # index i - k of the program without slots (the position the bubbles are keyed by).
        self.slot_of = {(r, i - k): a.fill_slot for r, acts in enumerate(filled.ranks)
                        for k, (i, a) in enumerate((i, a) for i, a in enumerate(acts) if a.kind is Kind.FILL)}

    def _measure(self, timelines: list[list]) -> None:
        """The bubbles over the last _WINDOW measuring steps (Note [fill slots everywhere])."""
        free = free_per_rank(self.engine.client.free_memory_bytes(),
                             self.engine.grid.rank_of, self.engine.num_ranks)  # every replica's
        self._recent.append(timelines)
        self.bubbles = find_bubbles(self.engine.program(TRAIN), list(self._recent), free)
        self._since_refresh = 0
        self._measured += 1

    def summary(self) -> str:
        return describe(list(self.jobs.values()))
