"""Profiling a running pipeline: ``pipe.profile(...)`` runs profiled training steps on
its engine and builds a ``ProfileReport`` (``report.py``) from what they recorded."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Optional, Sequence, Union

import schedules

from ..runtime import TRAIN, Engine
from .calibrate import stage_gradient_bytes
from .report import ProfileReport, StepRecord, build_report

__all__ = ["profile_pipeline", "clock_offsets", "message_bytes", "probe_links"]


def profile_pipeline(engine: Engine, inputs: Any, targets: Any, steps: int = 5, warmup: int = 2,
                     activation_bytes: float | Sequence[float] | None = None,
                     side: Optional[dict] = None) -> ProfileReport:
    """Run ``warmup`` ordinary then ``steps`` profiled training steps (all of them update
    the parameters, and count as steps) and build the report from the profiled ones.
    ``activation_bytes`` (per stage, its output's bytes) sizes the calibrated transfers;
    None: as the actors last sent them (``message_bytes``).  ``side``: the steps' side inputs
    by name (as ``pipe.step``'s keywords)."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup!r}")
    if engine.loss_fn is None:
        raise ValueError("profile runs training steps and needs a loss_fn: Pipeline(..., loss_fn=...)")
    for _ in range(warmup):  # shapes learnt, allocators and caches warm
        engine.train_step(inputs, targets, side=side)
    # Under TP the report shows each TP group by its TP rank 0 (the group runs one program in step;
    # its memory is per actor: Note [tensor parallelism] in actors/tensor_parallel.py), and under
    # CP each CP group by its CP rank 0 (the same program on every shard, the ring's exchanges
    # inside its compute: Note [context-parallel runtime] in actors/cp_runtime.py).
    grid = engine.grid
    shown = [i for i in range(engine.num_actors) if grid.coord(i).tp == 0 and grid.cp_rank_of(i) == 0]
    offsets = clock_offsets(engine, indices=shown)
    engine.client.memory_stats(reset=True)
    records = []
    for _ in range(steps):
        t0 = time.time_ns()
        result = engine.train_step(inputs, targets, side=side, profile=True)
        t1 = time.time_ns()
        records.append(StepRecord(t0, t1, engine.last_dispatch.wall_s, engine.last_dispatch.rpcs,
                                  [result.timelines[i] for i in shown], [result.replies[i].window for i in shown],
                                  [result.replies[i].waited for i in shown], [result.replies[i].exchanges for i in shown]))
    memory = engine.client.memory_stats(indices=shown)
    if activation_bytes is None:
        activation_bytes = message_bytes(engine)
    # Each stage's gradient bytes: with replicas, the all-reduce is fitted as latency plus
    # bytes over bandwidth across stages of different sizes (Note [runtime costs]).
    return build_report(schedule=engine.schedule, programs=engine.program(TRAIN), records=records,
                        offsets_ns=offsets, memory=memory, fusion=engine.config.dispatch.fusion,
                        dp=engine.config.layout.dp, zero=engine.config.layout.zero,
                        activation_bytes=activation_bytes, grad_bytes=stage_gradient_bytes(engine.stages))


def message_bytes(engine: Engine) -> tuple[int, ...]:
    """Per stage, the bytes of its output as the actors last sent it in a training step
    (0 for a stage that sends nothing: the last, or one whose next stage shares its actor)."""
    sizes: dict[int, int] = {}
    for got in engine.client.sent_bytes(TRAIN):
        for stage, n in got.items():
            sizes[int(stage)] = max(sizes.get(int(stage), 0), int(n))
    return tuple(sizes.get(s, 0) for s in range(engine.schedule.num_stages))


def probe_links(engine: Engine, sizes: Sequence[int] = (4096, 65536, 1 << 20, 4 << 20),
                repeats: int = 5) -> dict:
    """Per pair of pipeline ranks that exchange messages (replica 0), a ``schedules.LinkFit``
    of one-way message time against bytes (the median of ``repeats`` ping-pongs per size),
    probed between steps; the pair's both directions get it."""
    if engine.config.layout.tp > 1:
        raise ValueError("probing links (calibrate, auto_calibrate) is not supported with tp > 1 yet; pass "
                         "auto_calibrate=False, or calibrate a tp=1 pipeline of the same stages")
    pairs = sorted({tuple(sorted((r, ins.peer))) for r, prog in enumerate(engine.program(TRAIN)) for ins in prog
                    if ins.peer >= 0 and ins.peer != r})
    got = engine.client.probe_links([list(p) for p in pairs], list(sizes), repeats,
                                    indices=range(engine.schedule.num_ranks))
    samples: dict[tuple[int, int], list] = {}
    for rows in got:
        for a, b, n, sec in rows:
            samples.setdefault((a, b), []).append((n, sec))
    fits = {}
    for (a, b), obs in samples.items():
        # The median of each size: a probe preempted by another process says nothing of the link.
        by_size: dict[int, list[float]] = {}
        for n, sec in obs:
            by_size.setdefault(n, []).append(sec)
        fits[(a, b)] = fits[(b, a)] = schedules.fit_link([(n, statistics.median(v)) for n, v in by_size.items()])
    return fits


def clock_offsets(engine: Engine, probes: int = 5, indices: Optional[Sequence[int]] = None) -> list[int]:
    """Each actor's (of ``indices``: default all) clock minus the controller's, from the probe
    with the shortest round trip.

    An offset smaller than half that round trip cannot be told from zero (actors on the
    controller's own node share its clock) and is taken as 0.
    """
    indices = list(range(engine.num_actors)) if indices is None else list(indices)
    best: list[tuple[int, int]] = [(2**62, 0)] * len(indices)
    for _ in range(probes):
        for k, i in enumerate(indices):
            t0 = time.time_ns()
            remote = engine.client.clock_ns(i)
            t1 = time.time_ns()
            rtt = t1 - t0
            if rtt < best[k][0]:
                best[k] = (rtt, remote - (t0 + t1) // 2)
    return [0 if abs(off) <= rtt // 2 else off for rtt, off in best]


def calibrate_pipeline(engine: Engine, inputs: Any, targets: Any, steps: int,
                       activation_bytes: Union[float, Sequence[float], None], probe: bool) -> schedules.Costs:
    """``pipe.calibrate``: the cost model fitted on ``steps`` profiled steps, with each pair's
    link fitted from ping-pongs (``probe_links``) when ``probe``."""
    costs = profile_pipeline(engine, inputs, targets, steps, activation_bytes=activation_bytes).calibrated_costs
    if not probe:
        return costs
    fits = probe_links(engine)
    return dataclasses.replace(costs, links={pair: schedules.Link(f.latency, f.bandwidth) for pair, f in fits.items()})
