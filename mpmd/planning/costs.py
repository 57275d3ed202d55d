"""A stage's cost per microbatch, as ``schedule="auto"`` models it (Note [auto cost model]
in ``auto.py``): times measured at the candidate microbatch sizes and interpolated between
them, and the bytes a microbatch holds; and the runtime's own costs measured on the
actors (``RuntimeTerms``).

Note [cost curve]
-----------------
A stage's time is not affine in the microbatch's rows: gpt_auto's head (8192 logits)
took 5.5, 10.6, 21.9, 46.3 and 107.7 ms at 1, 2, 4, 8 and 16 rows on the controller,
and 21, 49 and 158 ms at 4, 8 and 16 rows on the actors; a line through the smallest
and the largest size overestimates the middle ones by up to 19%.  So ``plan_pipeline``
times every candidate size and ``StageCost.curve`` keeps them: ``at`` interpolates
linearly between neighbouring sizes and extends the end segments beyond them.  The
affine fields stay (through the smallest and the largest size) for a cost built by
hand and for one measured at two sizes.

Tried and dropped: each actor timing its own stages alone at every size (in its process,
threads and device) as the curve to correct.  Against the same schedule measured in the
pipeline at 2 and 8 rows, from a trial at 4 rows, it mispredicted more than the
controller's curve (ZB-V: mean |error| 0.26 against 0.11; interleaved 1F1B: 0.63 against
0.19): one probe of the head at 4 rows came out 1.6x another, and at 16 rows 2.3x the
controller's, which the pipeline did not show.  Trials at several sizes
(``replan.corrected_costs``) are what correct the curve per size.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, Optional, Sequence

import schedules
from schedules import Costs, Schedule, SimResult

from ..runtime.compile import lower_for_training
from .measure import Measurement
from .tp import collective_seconds, per_rank_share

__all__ = ["StageCost", "RuntimeTerms", "tp_terms", "a2a_terms"]

# the allocator's view of a microbatch, measured (Note [memory phases] in phases.py)
_PHASES = ("f_peak", "b_peak", "i_peak", "w_peak", "i_held", "r_held", "rb_peak", "rs_held", "ri_peak", "ri_held",
           "rw_peak")
_BYTES = ("act_bytes", "recompute_bytes", *_PHASES)  # with those, the bytes that scale with the microbatch


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageCost:
    """One stage's cost per microbatch of ``rows`` rows (seconds and bytes).

    ``f`` forward, ``b`` input-gradient backward (``I``), ``w`` weight-gradient backward
    (``W``), ``full`` a fused backward (``B``; default ``b + w``).  ``f0``, ``b0``, ``w0``,
    ``full0`` (default ``b0 + w0``) are the parts that do not shrink with the microbatch (Note [auto cost
    model]); ``at(rows)`` gives the costs at another microbatch size.  ``curve``, when it
    has two points or more, holds the times measured at several sizes, ``(rows, f, b, w,
    full)`` in increasing rows, and ``at`` interpolates them instead (Note [cost curve]).

    Tensor parallelism (Note [TP cost model] in tp.py): the times and bytes are the whole
    stage's (one device); ``tp_share`` is the share of its parameters and compute a TP
    plan shards, ``tp_forward`` / ``tp_backward`` its TP all-reduces in one forward / one
    input-gradient backward, ``tp_bytes`` the bytes of one (a microbatch's activation).

    Expert parallelism: ``a2a_f`` / ``a2a_b`` are the seconds of expert all-to-all in one
    forward / one input-gradient backward (``I`` or ``B``; ``W`` exchanges nothing), besides
    ``f``, ``b``, ``full`` (compute alone), with ``a2a_f0`` / ``a2a_b0`` their parts that do
    not shrink with the microbatch (Note [all-to-all costs] in schedules/costs.py; how they are
    estimated or measured: Note [all-to-all estimate] in a2a.py).
    """

    f: float
    b: float
    w: float
    full: Optional[float] = None
    act_bytes: float = 0.0
    out_bytes: float = 0.0
    param_bytes: float = 0.0
    rows: float = 1
    f0: float = 0.0
    b0: float = 0.0
    w0: float = 0.0
    full0: Optional[float] = None
    seed_bytes: float = 0.0  # held from I to W by a split backward (actors/split_backward.py)
    in_bytes: float = 0.0  # the stage's input: what a recomputed stage holds besides its output
    # a recomputed stage: the activations its recomputed forward holds during the backward
    # (a split backward from I to W: Note [recompute at I] in actors/stage_exec.py)
    recompute_bytes: float = 0.0
    # the allocator's view of one microbatch (Note [memory phases] in phases.py): what F, B, I
    # and W allocate on their way, and what stays live from I to W (0: not measured)
    f_peak: float = 0.0
    b_peak: float = 0.0
    i_peak: float = 0.0
    w_peak: float = 0.0
    i_held: float = 0.0
    # the same, recomputed (Note [recomputed phases] in phases.py; 0: not measured):
    # checkpointed F -> B, and recomputed at I (F -> I -> W)
    r_held: float = 0.0
    rb_peak: float = 0.0
    rs_held: float = 0.0
    ri_peak: float = 0.0
    ri_held: float = 0.0
    rw_peak: float = 0.0
    recompute: bool = False  # set by ``recomputed()``
    curve: tuple[tuple[float, float, float, float, float], ...] = ()
    tp_share: float = 0.0
    tp_forward: float = 0.0
    tp_backward: float = 0.0
    tp_bytes: float = 0.0
    # the routed experts' parameter bytes, all of them (part of ``param_bytes``, never TP-sharded):
    # each of the ``ep`` actors of an EP group holds 1/ep (Note [expert parallelism] in actors/grid.py)
    expert_bytes: float = 0.0
    a2a_f: float = 0.0
    a2a_b: float = 0.0
    a2a_f0: float = 0.0
    a2a_b0: float = 0.0

    def __post_init__(self) -> None:
        if self.full is None:
            object.__setattr__(self, "full", self.b + self.w)
        if self.full0 is None:
            object.__setattr__(self, "full0", self.b0 + self.w0)
        for name in ("f", "b", "w", "full", "out_bytes", "param_bytes", "f0", "b0", "w0", "full0",
                     "seed_bytes", "in_bytes", "tp_forward", "tp_backward", "tp_bytes", "expert_bytes", "a2a_f", "a2a_b",
                     "a2a_f0", "a2a_b0", *_BYTES):
            v = getattr(self, name)
            if not math.isfinite(v) or v < 0:
                raise ValueError(f"StageCost.{name} must be finite and >= 0, got {v!r}")
        if not 0.0 <= self.tp_share <= 1.0:
            raise ValueError(f"StageCost.tp_share must be in [0, 1], got {self.tp_share!r}")
        if not self.rows > 0:
            raise ValueError(f"StageCost.rows must be > 0, got {self.rows!r}")
        points = tuple(tuple(float(v) for v in point) for point in self.curve)
        if any(len(p) != 5 or not all(math.isfinite(v) and v >= 0 for v in p) or p[0] <= 0 for p in points) or \
                any(a[0] >= b[0] for a, b in zip(points, points[1:])):
            raise ValueError("StageCost.curve must be (rows, f, b, w, full) points, finite and >= 0, in increasing "
                             f"rows > 0, got {self.curve!r}")
        object.__setattr__(self, "curve", points)

    def at(self, rows: float) -> "StageCost":
        k = rows / self.rows

        def lin(x: float, x0: float) -> float:
            return max(0.0, x0 + (x - x0) * k)

        if len(self.curve) >= 2:
            f, b, w, full = _interpolate(self.curve, rows)
        else:
            f, b, w, full = lin(self.f, self.f0), lin(self.b, self.b0), lin(self.w, self.w0), lin(self.full, self.full0)
        return dataclasses.replace(self, f=f, b=b, w=w, full=full, out_bytes=self.out_bytes * k,
                                   seed_bytes=self.seed_bytes * k, in_bytes=self.in_bytes * k,
                                   tp_bytes=self.tp_bytes * k, rows=rows, a2a_f=lin(self.a2a_f, self.a2a_f0),
                                   a2a_b=lin(self.a2a_b, self.a2a_b0),
                                   **{name: getattr(self, name) * k for name in _BYTES})

    def params_at(self, tp: int) -> float:
        """Parameter bytes one of ``tp`` ranks holds (the sharded share divided by ``tp``)."""
        return self.param_bytes if tp == 1 else self.param_bytes * per_rank_share(self.tp_share, tp)

    def on_tp_rank(self, tp: int, latency: float, bytes_per_s: float) -> "StageCost":
        """What one of ``tp`` ranks spends: the sharded share of ``f, b, w, full`` divided, the
        TP all-reduces added to ``f`` and the backward (``b``, ``full``; none in ``w``): the
        times a trial on ``tp`` ranks measures (``replan.corrected_costs``)."""
        if tp == 1:
            return self
        k = per_rank_share(self.tp_share, tp)
        fwd = collective_seconds(self.tp_bytes, tp, self.tp_forward, latency, bytes_per_s)
        bwd = collective_seconds(self.tp_bytes, tp, self.tp_backward, latency, bytes_per_s)
        return dataclasses.replace(self.scaled(f=k, b=k, w=k, full=k), tp_share=0.0, tp_forward=0.0, tp_backward=0.0,
                                   param_bytes=self.params_at(tp)).with_added(fwd, bwd)

    def with_added(self, f: float, b: float) -> "StageCost":
        """The stage with ``f`` seconds more in its forward and ``b`` in its backward (``I``, ``B``)."""
        return dataclasses.replace(self, f=self.f + f, f0=self.f0 + f, b=self.b + b, b0=self.b0 + b,
                                   full=self.full + b, full0=self.full0 + b,
                                   curve=tuple((x, pf + f, pb + b, pw, pfull + b)
                                               for x, pf, pb, pw, pfull in self.curve))

    def with_curve(self, sizes: Sequence[float],
                   factor: Callable[[float], tuple[float, float, float, float]]) -> "StageCost":
        """The stage with a curve through its own costs at ``sizes`` (rows), each point's
        ``f, b, w, full`` multiplied by ``factor(rows)``: a correction that depends on the
        microbatch size (``replan.corrected_costs``)."""
        points = []
        for rows in sorted(set(sizes)):
            c, k = self.at(rows), factor(rows)
            points.append((rows, c.f * k[0], c.b * k[1], c.w * k[2], c.full * k[3]))
        top = points[-1]
        return dataclasses.replace(self.at(top[0]), f=top[1], b=top[2], w=top[3], full=top[4],
                                   curve=tuple(points) if len(points) >= 2 else ())

    def recomputed(self) -> "StageCost":
        """The stage with its forward recomputed in the backward (``Pipeline(recompute=...)``):
        a microbatch holds only its input and output until the backward, which runs the
        forward again first, holding its activations through the backward (from I to W when
        the backward is split)."""
        # the forward run again in the backward exchanges again too (schedules/expert_order.py)
        return dataclasses.replace(self, act_bytes=self.in_bytes + self.out_bytes, recompute_bytes=self.act_bytes,
                                   recompute=True, b=self.b + self.f, a2a_b=self.a2a_b + self.a2a_f,
                                   a2a_b0=self.a2a_b0 + self.a2a_f0,
                                   full=self.full + self.f, b0=self.b0 + self.f0, full0=self.full0 + self.f0,
                                   curve=tuple((x, f, b + f, w, full + f) for x, f, b, w, full in self.curve))

    def scaled(self, *, f: float = 1.0, b: float = 1.0, w: float = 1.0, full: float = 1.0) -> "StageCost":
        """The stage with its times multiplied, fixed parts alike (measured over predicted)."""
        return dataclasses.replace(self, f=self.f * f, f0=self.f0 * f, b=self.b * b, b0=self.b0 * b, w=self.w * w,
                                   w0=self.w0 * w, full=self.full * full, full0=self.full0 * full,
                                   curve=tuple((x, pf * f, pb * b, pw * w, pfull * full)
                                               for x, pf, pb, pw, pfull in self.curve))

    @classmethod
    def through(cls, points: Sequence[tuple[float, Measurement]]) -> "StageCost":
        """The cost through measurements at several sizes, ``(rows, measurement)``: affine
        through the smallest and the largest, and with three sizes or more a ``curve``
        through all of them (Note [cost curve])."""
        points = sorted(points, key=lambda p: p[0])
        (lo_rows, lo), (hi_rows, hi) = points[0], points[-1]
        cost = cls.fit(lo, lo_rows, hi, hi_rows)
        if len(points) < 3:
            return cost
        return dataclasses.replace(cost, curve=tuple((x, m.f, m.b, m.w, m.full) for x, m in points))

    @classmethod
    def fit(cls, lo: Measurement, lo_rows: float, hi: Measurement, hi_rows: float) -> "StageCost":
        """The affine cost through two measurements (one when the sizes are equal)."""
        at_hi = dict(f=hi.f, b=hi.b, w=hi.w, full=hi.full, act_bytes=hi.act_bytes, out_bytes=hi.out_bytes,
                     param_bytes=hi.param_bytes, seed_bytes=hi.seed_bytes, in_bytes=hi.in_bytes, rows=hi_rows,
                     **{name: getattr(hi, name) for name in _PHASES})
        if hi_rows == lo_rows:
            return cls(**at_hi)

        def fixed(a: float, c: float) -> float:
            slope = max(0.0, (c - a) / (hi_rows - lo_rows))
            return min(c, max(0.0, a - slope * lo_rows))

        return cls(**at_hi, f0=fixed(lo.f, hi.f), b0=fixed(lo.b, hi.b), w0=fixed(lo.w, hi.w),
                   full0=fixed(lo.full, hi.full))


def _interpolate(curve: Sequence[tuple[float, ...]], rows: float) -> tuple[float, float, float, float]:
    """``f, b, w, full`` at ``rows`` on the piecewise-linear ``curve`` (its end segments
    extended beyond it, never below zero)."""
    i = 1
    while i < len(curve) - 1 and curve[i][0] < rows:
        i += 1
    (x0, *lo), (x1, *hi) = curve[i - 1], curve[i]
    t = (rows - x0) / (x1 - x0)
    return tuple(max(0.0, a + (c - a) * t) for a, c in zip(lo, hi))  # type: ignore[return-value]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeTerms:
    """What the actors pay besides the stages' compute, measured on them (``pipe.calibrate``)
    and put in a form any candidate plan can use: Note [calibrated auto] in ``replan.py``.

    The per-pair links of a calibration belong to one placement, so a candidate gets their
    mean latency and bandwidth; launch is the ranks' mean; the optimizer step costs
    ``optimizer_per_byte`` seconds per byte of the parameters a rank holds; with ``dp > 1``
    a stage's all-reduce costs the stages' mean latency plus its gradient (its parameter
    bytes) over ``allreduce_bandwidth``.
    """

    task: float = 0.0
    message: float = 0.0
    send: Optional[float] = None
    latency: float = 0.0
    bandwidth: float = math.inf
    prefetch: int = 0
    launch: float = 0.0
    step_overhead: float = 0.0
    optimizer_per_byte: float = 0.0
    dp: int = 1
    allreduce_latency: float = 0.0
    allreduce_bandwidth: float = math.inf
    zero: int = 0  # ZeRO-1: a reduce-scatter at the ALLREDUCE, an all-gather after the step (Costs.zero)
    overlap_reduce: bool = False  # the ALLREDUCE's transfer runs beside the last backward (Costs.overlap_reduce)
    tp: int = 1  # ranks each stage is sharded over (Note [TP cost model] in tp.py)
    tp_latency: float = 0.0  # one TP all-reduce's fixed seconds
    tp_bandwidth: float = math.inf  # bytes/second a TP rank moves in the ring

    @classmethod
    def from_costs(cls, costs: Costs, param_bytes_per_rank: Sequence[float], dp: int = 1) -> "RuntimeTerms":
        """The terms of a calibration (``schedules.Costs`` with runtime terms) on a placement
        whose rank ``r`` holds ``param_bytes_per_rank[r]`` bytes of parameters."""
        links = list(costs.links.values())
        latency = statistics.fmean(link.latency for link in links) if links else costs.latency
        finite = [link.bandwidth for link in links if math.isfinite(link.bandwidth)]
        # The harmonic mean: what a byte costs on average over the links.
        bandwidth = len(finite) / sum(1.0 / b for b in finite) if finite else costs.bandwidth
        total = sum(param_bytes_per_rank)
        return cls(task=costs.task, message=costs.message, send=costs.send, latency=latency, bandwidth=bandwidth,
                   prefetch=costs.prefetch, launch=statistics.fmean(costs.values("launch")),
                   step_overhead=costs.step_overhead,
                   optimizer_per_byte=sum(costs.values("optimizer")) / total if total > 0 else 0.0, dp=dp,
                   allreduce_latency=statistics.fmean(costs.values("allreduce_latency")),
                   allreduce_bandwidth=costs.allreduce_bandwidth, zero=costs.zero,
                   overlap_reduce=costs.overlap_reduce)

    def simulate(self, sched: Schedule, stage_costs: Sequence[StageCost], split: bool) -> SimResult:
        """``sched`` lowered as the engine lowers it, simulated at instruction level with
        these terms and ``stage_costs`` (``split``: the backward runs as ``I`` and ``W``)."""
        lowered = lower_for_training(sched, self.dp)
        params = [sum(stage_costs[s].params_at(self.tp) for s in sched.stages_of(r)) for r in range(sched.num_ranks)]
        return schedules.simulate(lowered, Costs(
            f=[c.f for c in stage_costs], b=[c.b if split else c.full for c in stage_costs],
            w=[c.w if split else 0.0 for c in stage_costs], fused=[c.full for c in stage_costs], task=self.task, message=self.message, send=self.send,
            dp=self.dp, grad_bytes=[c.params_at(self.tp) for c in stage_costs],  # a TP rank reduces its shards
            allreduce_latency=self.allreduce_latency,
            allreduce_bandwidth=self.allreduce_bandwidth, latency=self.latency, bandwidth=self.bandwidth,
            activation_bytes=[c.out_bytes for c in stage_costs],
            prefetch=self.prefetch, launch=self.launch, optimizer=[self.optimizer_per_byte * p for p in params],
            step_overhead=self.step_overhead, zero=self.zero, overlap_reduce=self.overlap_reduce,
            **tp_terms(stage_costs, self.tp, self.tp_latency, self.tp_bandwidth), **a2a_terms(stage_costs)))


def a2a_terms(stage_costs: Sequence[StageCost]) -> dict:
    """The ``schedules.Costs`` fields that charge the expert all-to-alls (Note [all-to-all costs]):
    none when no stage has any."""
    if not any(c.a2a_f or c.a2a_b for c in stage_costs):
        return {}
    return dict(a2a_f=[c.a2a_f for c in stage_costs], a2a_b=[c.a2a_b for c in stage_costs])


def tp_terms(stage_costs: Sequence[StageCost], tp: int, latency: float, bytes_per_s: float) -> dict:
    """The ``schedules.Costs`` fields that charge ``tp`` (Note [runtime costs]): none at 1."""
    if tp == 1:
        return {}
    return dict(tp=tp, tp_sharded=[c.tp_share for c in stage_costs], tp_forward=[c.tp_forward for c in stage_costs],
                tp_backward=[c.tp_backward for c in stage_costs], tp_bytes=[c.tp_bytes for c in stage_costs],
                tp_latency=latency, tp_bandwidth=bytes_per_s)
