"""A PipeFill job: independent work for the bubbles, and its progress and cost model.

The controller hands a job's inputs out in chunks (``take``; ``give_back`` for chunks
that did not run), records what the actors report (``record``), stores the outputs once
they are fetched (``store``) and forgets those lost with a dead actor (``lose``), so every
input is processed exactly once.  Planning and measuring bubbles: ``planner.py``;
driving a pipeline: ``manager.py``.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any, Callable, Optional, Sequence

import torch

from actors.fill import unbatch
from actors.protocol import ChunkResult

__all__ = ["FillJob", "ON_ACTOR"]

ON_ACTOR = object()  # a chunk's outputs, still held by the actor that ran it


@dataclasses.dataclass(eq=False, kw_only=True)
class FillJob:
    """Independent work for the bubbles: ``fn(batch)`` over ``data``, one output per input.

    ``fn`` gets a stacked batch of inputs (``collate=True``; tensors of one shape) or the
    list of inputs (``collate=False``) and returns one output per input.  It must not
    touch the main job's parameters; it runs on an actor's device, under its own fork of
    the global RNG (the main job's random stream is untouched).  ``cost_per_sample``
    (seconds) and ``memory_per_sample`` (bytes) are measured when not given.  Once the job is
    done and its outputs are on the controller, the pipeline releases its inputs (``data``
    becomes empty; ``num_inputs`` keeps their count): a long-running pipeline holds no
    finished job's inputs.
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
        self.num_inputs = len(self.data)
        self.id = -1  # set when added to a pipeline
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
        self.plans_since_run = 0  # plans (with bubbles) since a chunk of this job last ran (Note [no starving])
        self._fetch: Optional[Callable[[], None]] = None  # brings outputs over from the actors

    def attach(self, job_id: int, fetch: Callable[[], None]) -> None:
        """Added to a pipeline as job ``job_id``; ``fetch()`` brings its outputs over from the actors."""
        if self.id >= 0:
            raise ValueError(f"fill job {self.name!r} was already added to a pipeline")
        self.id, self._fetch = job_id, fetch

    @property
    def remaining(self) -> int:
        if self.error is not None:
            return 0
        return self.num_inputs - self.next + sum(n for _, n in self._returned)

    def take(self, n: int) -> tuple[int, int]:
        """Hand out up to ``n`` consecutive inputs: ``(start, count)``; given-back ranges first."""
        if self._returned:
            start, have = self._returned[0]
            count = min(n, have)
            self._returned[0:1] = [(start + count, have - count)] if count < have else []
            return start, count
        count = min(n, self.num_inputs - self.next)
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

    def lose(self, start: int) -> int:
        """The chunk at ``start`` was processed but its outputs were lost (its actor died
        before they were fetched): its inputs are handed out again.  How many."""
        n, _ = self._chunks.pop(start)
        self._filled -= n
        self.give_back(start, n)
        return n

    def store(self, start: int, outputs: Any) -> None:
        """The outputs of the chunk at ``start``, fetched from the actor that ran it."""
        n, _ = self._chunks[start]
        self._chunks[start] = (n, outputs)

    @property
    def processed(self) -> int:
        """Inputs processed so far (their outputs may still be on the actors)."""
        return self._filled

    def done(self) -> bool:
        """Every input processed (or the job failed)."""
        return self.error is not None or self._filled == self.num_inputs

    def outputs_here(self) -> bool:
        """Every output the actors made is on the controller (none still ``ON_ACTOR``)."""
        return all(out is not ON_ACTOR for _, out in self._chunks.values())

    def release(self) -> None:
        """Forget the inputs: the job is done and its outputs are here (the docstring)."""
        self.data, self._stacked = [], None

    def failed(self) -> bool:
        return self.error is not None

    def results(self) -> list:
        """Outputs in input order; raises if the job failed or is not done."""
        if self._fetch is not None:
            self._fetch()
        if self.error is not None:
            raise RuntimeError(f"fill job {self.name!r} failed:\n{self.error}")
        if not self.done():
            raise RuntimeError(f"fill job {self.name!r} is not done: {self._filled}/{self.num_inputs} inputs processed")
        # Per-input outputs are cut from the returned batches only now, off the training path.
        return [out for start in sorted(self._chunks) for out in unbatch(self._chunks[start][1], self._chunks[start][0])]

    def shipment(self):
        """Every input, as shipped once to the actors: one stacked array when collating
        same-shape tensors (chunks are slices of it), else the list."""
        return self._stacked if self._stacked is not None else self.data

    def record(self, result: ChunkResult) -> None:
        """A chunk an actor ran (its outputs stay there, ``ON_ACTOR``, until stored)."""
        self.busy_seconds += result.seconds
        self.plans_since_run = 0
        if result.error is not None:
            self.error = self.error or result.error
            return
        if result.start in self._chunks:
            raise AssertionError(f"fill inputs from {result.start} of {self.name!r} processed twice")
        self._chunks[result.start] = (result.n, ON_ACTOR)
        self._filled += result.n
        self._observed = (self._observed + [(result.n, result.seconds)])[-32:]
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
    slope = statistics.median(slopes)
    if slope <= 0:
        # The sizes do not separate a fixed cost from the work (a small chunk slowed by something
        # else: e.g. the probe of 1 ran while an actor was dying).  Fitted as it stands, the
        # intercept would be that slow chunk and no chunk would ever fit a bubble again, so the
        # job would stop for good.  Charge it all per input, at the cheapest rate seen.
        return 0.0, max(min(t / n for n, t in observed if n > 0), 1e-9)
    # No chunk runs faster than the fixed cost: the fastest one seen bounds it (a fit through
    # slow chunks must not claim an overhead that no bubble holds; Note [no starving]).
    overhead = min(statistics.median([t - slope * n for n, t in observed]), min(t for _, t in observed))
    return max(0.0, overhead), slope
