"""The calibrated cost model: every runtime term of ``schedules.Costs`` (Note [runtime
costs] in schedules/costs.py) measured from profiled steps.  Pure: no Ray.

From the slices of a profile (each instruction's start and end on the controller's
clock):

* ``f``, ``b``, ``w`` per stage: the mean duration of its ``F``, ``B``/``I``, ``W``;
* ``task``: the mean gap between consecutive instructions of a rank, plus the bodies of
  the instructions that move no data (``FREE``, ``FILL``, the ``ALLREDUCE`` of one
  replica), spread over every instruction;
* with data-parallel replicas (``dp``: the profile's actors over its ranks), the
  ``ALLREDUCE`` of each stage: ``schedules.fit_link`` over its slices (every replica's,
  so the wait for a later replica counts) against the bytes a ring moves through each
  replica, ``2 (dp - 1) / dp * grad_bytes[s]``, giving ``allreduce_latency`` and
  ``allreduce_bandwidth``; with fewer than two gradient sizes known, each stage's mean
  slice is its ``allreduce_latency``.  When the reductions overlapped the backward (Note
  [overlapped dp reduction]: the profile has ``DP_REDUCE`` slices; ``overlap_reduce``), an
  ``ALLREDUCE`` slice holds only what its stage's last backward left exposed:
  ``allreduce_latency + max(0, ring / allreduce_bandwidth - window)``, ``window`` from that
  backward's start to the ``ALLREDUCE``'s (Note [runtime costs]); the two terms are fitted
  to that, the ``ALLREDUCE``s whose transfer outlasted its window telling the bandwidth (none
  did: the bandwidth is only bounded, by the windows, and the bound is taken);
* ``send``: the mean duration of the sends (posting); ``message``: the median duration
  of the receives whose message had been sent before they started (completing; with none,
  of the sends).  A send's mean, not its median: on a loaded machine posting a send has a
  long tail (1.9-3.1 ms mean against 0.2-0.3 ms median, load 8-11) that the step pays;
  Note [task from gaps] says why this, not ``fit_overhead``, carries it;
* per pair of ranks ``(src, dst)``, a ``Link``: ``schedules.fit_link`` over the receives
  that waited, each message's time from its send's end to its receive's end less
  ``message``, against its bytes (``activation_bytes`` per stage boundary; with one size,
  all of it is latency);
* ``launch`` per rank: the median time from the controller issuing the step to the
  rank's first instruction; ``optimizer`` per rank: the mean ``OPT`` slice;
  ``step_overhead``: the median time from the last optimizer step ended to the controller
  holding every result.  Medians for these fixed costs: a step whose launch another
  process preempted (30 ms on 1F1B in one run, 2 ms in the others) says nothing of them;
  the work's own costs stay means, since contention stretches all of it alike;
* ``prefetch``: the receives the runtime posts ahead (Note [receive prefetch] in
  actors/transfers.py);
* ``a2a_f``, ``a2a_b`` per stage (Note [all-to-all costs] in schedules/costs.py), given the
  profile's expert all-to-alls (``ProfileReport.all_to_all``): the mean seconds of exchange
  inside a stage's ``F``, and inside its ``B`` and ``I`` together; ``f``, ``b``, ``fused`` are
  then the compute alone, each kind's mean less the exchange inside that kind.  An
  ``OVERLAP``'s slice tells neither (its parts' computes and exchanges interleave): the
  costs come from the forwards and backwards that ran alone.

Note [task from gaps]
---------------------
``task`` is read from the gaps between a rank's instructions, not fitted with
``schedules.fit_overhead`` (each instruction's time on its rank, from the previous
one's end to its own, against its modelled body).  On the bench GPT under load (8
schedule-runs, load 8-11) the fit did predict held-out steps better than the model
then (mean |measured/predicted - 1| 0.075 against 0.181), but not by finding a per-task
cost: its intercept, 0.2-1.4 ms per instruction, is 20-150 times the gaps measured in
the same steps (3-10 us), and its slope (0.75-0.96) shrinks the compute to make room.
What it absorbed is the sends' tail, which the pooled median ``message`` left out:
charging a send its mean (``send``) instead does as well (0.072, max 0.20 as the fit's)
and keeps ``f``, ``b``, ``w`` the measured means, which the planner reads.  When nothing
contends (1F1B of one run) the fit gives the gaps back (0.02 ms, slope 0.99).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Callable, NamedTuple, Optional, Sequence

import schedules
from actors.protocol import OPTIMIZER_STEP
from actors.worker import StageWorker
from schedules import Costs, Kind, Link, Schedule

from .slices import DPREDUCE, Slice

__all__ = ["calibrated_costs", "lowered_from_programs", "held_out", "HeldOut", "stage_gradient_bytes"]

_NO_DATA = frozenset({"FREE", "FILL", "ALLREDUCE"})


def lowered_from_programs(schedule: Schedule, programs: list) -> Schedule:
    """The lowered schedule the programs were compiled from (one action per instruction)."""
    return schedule.replace(ranks=tuple(tuple(ins.action for ins in prog) for prog in programs))


def calibrated_costs(schedule: Schedule, programs: list, slices: Sequence[Slice],
                     step_windows_ns: Sequence[tuple[int, int]],
                     activation_bytes: float | Sequence[float] = 0.0,
                     grad_bytes: float | Sequence[float] = 0.0, zero: int = 0,
                     exchanges: Sequence[Slice] = ()) -> Costs:
    """The cost model of the profiled steps; ``programs[rank]`` lists ``actors.program.Instr``;
    ``grad_bytes``: per stage, the bytes of its gradients (``stage_gradient_bytes``); ``zero``:
    the pipeline's (ZeRO-1: the ``ALLREDUCE`` was a reduce-scatter, ``Costs.zero``);
    ``exchanges``: the expert all-to-alls of the same steps (``ProfileReport.all_to_all``)."""
    num_ranks = schedule.num_ranks
    dp = 1 + max((s.actor for s in slices), default=0) // num_ranks
    no_data_kinds = _NO_DATA if dp == 1 else _NO_DATA - {"ALLREDUCE"}
    by_kind: dict[tuple[str, int], list[float]] = defaultdict(list)
    opt: dict[int, list[float]] = defaultdict(list)
    runs: dict[tuple[int, int], list[Slice]] = defaultdict(list)
    for s in slices:
        runs[(s.step, s.actor)].append(s)
        if s.index == OPTIMIZER_STEP:
            opt[s.actor % num_ranks].append(s.seconds)
        elif s.index >= 0:  # not ZeRO-1's all-gather (ALL_GATHER)
            by_kind[(s.kind, programs[s.actor % num_ranks][s.index].stage)].append(s.seconds)
    gaps, no_data, count, sends = [], [], 0, {}
    for (step, actor), run in runs.items():
        run.sort(key=lambda s: s.start_ns)
        prog = [s for s in run if s.index >= 0]
        count += len(prog)
        # The gap before the optimizer step is the wait for the sends' delivery, not a task's start.
        gaps += [max(0, b.start_ns - a.end_ns) * 1e-9 for a, b in zip(prog, prog[1:])]
        no_data += [s.seconds for s in prog if s.kind in no_data_kinds]
        for s in prog:
            if s.kind in ("SEND_F", "SEND_B"):
                ins = programs[actor % num_ranks][s.index]
                sends[(step, actor // num_ranks, s.kind, ins.stage, ins.microbatch)] = s
    task = _mean(gaps) + (sum(no_data) / count if count else 0.0)
    send_s = [s.seconds for s in sends.values()]
    ready, waited = [], defaultdict(list)
    for s in slices:
        if s.kind not in ("RECV_F", "RECV_B"):
            continue
        ins = programs[s.actor % num_ranks][s.index]
        off = -1 if s.kind == "RECV_F" else +1
        snd = sends.get((s.step, s.actor // num_ranks, "SEND_F" if off < 0 else "SEND_B", ins.stage + off,
                         ins.microbatch))
        if snd is None:
            continue
        if snd.end_ns <= s.start_ns:
            ready.append(s.seconds)
        else:
            boundary = min(ins.stage, ins.stage + off)
            waited[(snd.actor % num_ranks, s.actor % num_ranks)].append((boundary, (s.end_ns - snd.end_ns) * 1e-9))
    # A median for completing a receive: ready receives are few, and one preempted among them
    # would swamp a mean.  A send is posted as often as there are messages: its mean holds.
    message = _median(ready or send_s)
    nbytes = lambda st: schedules.Costs(activation_bytes=activation_bytes).at("activation_bytes", st)  # noqa: E731
    links = {}
    for pair, obs in waited.items():
        fit = schedules.fit_link([(nbytes(st), max(0.0, sec - message)) for st, sec in obs])
        links[pair] = Link(fit.latency, fit.bandwidth)
    inside = _exchange_inside(slices, exchanges, programs, num_ranks)
    f, b, w, fused = stage_task_costs(schedule, lambda kind, st: _mean(by_kind[(kind, st)]) - _mean(inside[(kind, st)])
                                      if by_kind[(kind, st)] else None)
    a2a_f = tuple(_mean(inside[("F", st)]) for st in range(schedule.num_stages))
    a2a_b = tuple(_mean(inside[("B", st)] + inside[("I", st)]) for st in range(schedule.num_stages))
    launch: dict[int, list[float]] = defaultdict(list)
    overhead = []
    for k, (t0, t1) in enumerate(step_windows_ns):
        mine = [s for s in slices if s.step == k]
        if not mine:
            continue
        overhead.append(max(0, t1 - max(s.end_ns for s in mine)) * 1e-9)
        first: dict[int, int] = {}
        for s in mine:
            first[s.actor] = min(first.get(s.actor, s.start_ns), s.start_ns)
        for r in range(num_ranks):  # the slowest replica of the rank
            starts = [first[a] for a in first if a % num_ranks == r]
            if starts:
                launch[r].append(max(0, max(starts) - t0) * 1e-9)
    lat = _mean([link.latency for link in links.values()])
    overlap = any(s.kind == DPREDUCE for s in slices)
    ar_latency, ar_bandwidth = _allreduce(schedule.num_stages, dp, grad_bytes, by_kind, 1.0 if zero else 2.0,
                                          _windows(runs, programs, num_ranks) if overlap else None)
    return Costs(f=f, b=b, w=w, fused=fused, task=task, message=message, send=_mean(send_s), latency=lat,
                 activation_bytes=activation_bytes, links=links, prefetch=StageWorker.PREFETCH,
                 launch=tuple(_median(launch[r]) for r in range(num_ranks)),
                 optimizer=tuple(_mean(opt[r]) for r in range(num_ranks)), step_overhead=_median(overhead),
                 dp=dp, grad_bytes=grad_bytes, allreduce_latency=ar_latency, allreduce_bandwidth=ar_bandwidth,
                 zero=zero, overlap_reduce=overlap, a2a_f=a2a_f, a2a_b=a2a_b)


def _exchange_inside(slices: Sequence[Slice], exchanges: Sequence[Slice], programs: list,
                     num_ranks: int) -> dict[tuple[str, int], list[float]]:
    """Per (kind, stage) of the single computes (``F``, ``B``, ``I``), the seconds of expert
    all-to-all inside each of its slices (0 for one without); empty without ``exchanges``."""
    out: dict[tuple[str, int], list[float]] = defaultdict(list)
    if not exchanges:
        return out
    spent: dict[tuple[int, int, int], float] = defaultdict(float)  # (step, actor, position) -> seconds
    for e in exchanges:
        spent[(e.step, e.actor, e.index)] += e.seconds
    for s in slices:
        if s.kind in ("F", "B", "I") and s.index >= 0:
            out[(s.kind, programs[s.actor % num_ranks][s.index].stage)].append(spent[(s.step, s.actor, s.index)])
    return out


def _allreduce(num_stages: int, dp: int, grad_bytes, by_kind, passes: float, windows: Optional[dict]) -> tuple:
    """``(allreduce_latency, allreduce_bandwidth)`` from the ``ALLREDUCE`` slices per stage
    (``passes``: 2 for an all-reduce's ring, 1 for ZeRO-1's reduce-scatter; ``windows``: per
    stage, ``(window, exposed)`` of each overlapped one, ``_windows``)."""
    if dp == 1:
        return 0.0, float("inf")
    sizes = Costs(grad_bytes=grad_bytes)
    ring = {st: passes * (dp - 1) / dp * sizes.at("grad_bytes", st) for st in range(num_stages)}
    if windows is not None:
        obs = [(ring[st], w, e) for st in range(num_stages) for w, e in windows[st]]
        fit = _fit_overlapped(obs) if len({r for r, _, _ in obs}) >= 2 else None
        if fit is not None:
            return fit
        return tuple(_mean([e for _, e in windows[st]]) for st in range(num_stages)), float("inf")
    obs = [(ring[st], sec) for st in range(num_stages) for sec in by_kind[("ALLREDUCE", st)]]
    if len({ring[st] for st in range(num_stages) if by_kind[("ALLREDUCE", st)]}) >= 2:
        fit = schedules.fit_link(obs)
        return fit.latency, fit.bandwidth
    return tuple(_mean(by_kind[("ALLREDUCE", st)]) for st in range(num_stages)), float("inf")


def _windows(runs: dict, programs: list, num_ranks: int) -> dict[int, list[tuple[float, float]]]:
    """Per stage, ``(window, exposed)`` seconds of each ``ALLREDUCE``: from its stage's last
    backward's start to the ``ALLREDUCE``'s start, and the ``ALLREDUCE``'s own."""
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for (_, actor), run in runs.items():
        began: dict[int, int] = {}
        for s in sorted((s for s in run if s.index >= 0), key=lambda s: s.start_ns):
            ins = programs[actor % num_ranks][s.index]
            stage = ins.stage
            for part in ins.parts or (ins,):  # an OVERLAP's backward too
                if part.kind in (Kind.B, Kind.W):
                    began[part.stage] = s.start_ns
            if s.kind == "ALLREDUCE" and stage in began:
                out[stage].append(((s.start_ns - began[stage]) * 1e-9, s.seconds))
    return out


def _fit_overlapped(obs: list[tuple[float, float, float]]) -> Optional[tuple[float, float]]:
    """``(latency, bandwidth)`` that best give ``exposed = latency + max(0, ring / bandwidth -
    window)`` over ``obs`` of ``(ring, window, exposed)``: a line through the exposed ones'
    ``exposed + window`` and the hidden ones' ``exposed``, for each split of ``obs`` by
    ``ring / window`` (the larger, the likelier exposed); None when no split has two ring sizes."""
    order = sorted(obs, key=lambda o: o[0] / o[1] if o[1] > 0 else float("inf"), reverse=True)
    best, best_err = None, float("inf")
    for k in range(1, len(order) + 1):  # order[:k] exposed
        points = [(r, e + w) for r, w, e in order[:k]] + [(0.0, e) for _, _, e in order[k:]]
        if len({x for x, _ in points}) < 2:
            continue
        fit = schedules.fit_link(points)
        moved = lambda r: r / fit.bandwidth if math.isfinite(fit.bandwidth) else 0.0  # noqa: E731
        err = sum((fit.latency + max(0.0, moved(r) - w) - e) ** 2 for r, w, e in obs)
        if err < best_err:
            best, best_err = (fit.latency, fit.bandwidth), err
    return best


def stage_gradient_bytes(stages) -> tuple[int, ...]:
    """Per stage (a ``torch.nn.Module``, on any device, meta included), the bytes of the
    gradients its ``ALLREDUCE`` averages: its parameters that require them."""
    return tuple(sum(p.numel() * p.element_size() for p in m.parameters() if p.requires_grad) for m in stages)


class HeldOut(NamedTuple):
    measured: float  # mean step time of the scored profiled steps
    predicted: float  # what the model fitted on the other steps predicts for them
    bubble: float  # the simulated bubble of those models


def held_out(report, schedule: Schedule, programs: list) -> HeldOut:
    """Fit the calibrated model on the even profiled steps and predict the odd ones, and the
    other way round: the prediction is never scored on the steps it was fitted on, and a
    slow spell of the shared machine (slower than a step) falls on both halves alike."""
    if report.steps < 2:
        raise ValueError(f"held_out needs a profile of at least 2 steps, got {report.steps}; profile(steps=6)")
    lowered = lowered_from_programs(schedule, programs)
    walls, preds, bubbles = [], [], []
    for fit_on in (0, 1):
        fit_steps = [k for k in range(report.steps) if k % 2 == fit_on]
        renum = {k: i for i, k in enumerate(fit_steps)}
        slices = [s._replace(step=renum[s.step]) for s in report.slices if s.step in renum]
        exchanges = [s._replace(step=renum[s.step]) for s in report.all_to_all if s.step in renum]
        costs = calibrated_costs(schedule, programs, slices,
                                 [report.step_windows_ns[k] for k in fit_steps],
                                 report.calibrated_costs.activation_bytes, report.calibrated_costs.grad_bytes,
                                 report.calibrated_costs.zero, exchanges)
        sim = schedules.simulate(lowered, costs)
        scored = [k for k in range(report.steps) if k % 2 != fit_on]
        walls += [report.step_seconds_each[k] for k in scored]
        preds += [sim.step_time] * len(scored)
        bubbles.append(sim.bubble_fraction)
    return HeldOut(_mean(walls), _mean(preds), _mean(bubbles))


def stage_task_costs(schedule: Schedule, mean: Callable[[str, int], Optional[float]],
                     around_f: Callable[[int], float] = lambda st: 0.0,
                     around_b: Callable[[int], float] = lambda st: 0.0) -> tuple[tuple, tuple, tuple, tuple]:
    """Per stage, the simulator's ``f``, ``b``, ``w`` and ``fused`` from ``mean(kind, stage)``
    (a kind's mean measured cost at a stage, None where the stage ran none of it), plus what
    ``around_f`` / ``around_b`` add to a forward / a backward (its sends and receives).  ``b``
    is the stage's ``B``, or ``I`` where the schedule splits it; a stage that splits some
    backwards and fuses others (schedules/fuse.py) has ``fused`` measured, one that ran only
    split ones ``I + W``."""
    f, b, w, fused = [], [], [], []
    for st in range(schedule.num_stages):
        split = schedule.backward_kind[st] is Kind.I
        f.append((mean("F", st) or 0.0) + around_f(st))
        b.append((mean("I" if split else "B", st) or 0.0) + around_b(st))
        w.append((mean("W", st) or 0.0) if split else 0.0)
        ran_fused = mean("B", st)
        fused.append(ran_fused + around_b(st) if ran_fused is not None else b[-1] + w[-1])
    return tuple(f), tuple(b), tuple(w), tuple(fused)


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _median(xs: Sequence[float]) -> float:
    return sorted(xs)[len(xs) // 2] if xs else 0.0
