"""``schedule="auto"`` / ``num_microbatches="auto"`` decided again from what the actors
measure: a trial of the provisional plan, one re-plan, the faster measured plan kept.

Note [calibrated auto]
----------------------
``plan_pipeline`` times the stages on the controller, which gives a provisional answer
only: on the actors the same stages ran 0.71-1.77x as long (other processes on the
cores, another thread count), and the runtime pays per task, per message and per step
what no in-process timing sees.  So the Pipeline (``auto_calibrate=True``, the default)
starts the provisional plan and runs a *trial* on its actors (``Trial``, built in
``mpmd/assemble.py``): ordinary steps, timed; profiled steps and link probes calibrate
the cost model (``pipe.calibrate``); then the actors' state goes back to a checkpoint
taken before the trial, so the trial leaves no trace in training.  From the trial:

* every stage's costs are the controller's (measured at every candidate size, Note [cost
  curve] in costs.py) scaled by measured / predicted at the trial's microbatch size, per
  kind (``F``; ``B``, or ``I`` and ``W``).  A stage that ran only fused backwards scales
  ``I`` and ``W`` like ``B`` (their split still comes from the controller), one that ran
  only split ones its ``B`` like ``I + W`` (``Trial.ran``).  Once trials ran at several sizes,
  each size gets its own factor (interpolated in log rows between them, held beyond):
  the actors' cost grows faster with rows than the controller's (gpt_auto's head: 0.96x
  the controller's time at 4 rows, 1.47x at 16), so one factor mispredicts the others;
* the runtime's own costs (``RuntimeTerms``) make every candidate simulate at
  instruction level, lowered as the engine runs it.

The same actors then run the same plan at two other sizes (Note [size sweep]).  Every
candidate is ranked again (``replan``).  Trials follow, 3 in all at most, each
on fresh actors: the new winner; then, among the options predicted within 20% of it,
one at the microbatch count farthest from the counts tried (a correction measured at
one size misled at others: on gpt_auto, trials at m=8 and 16 left m=2 and 4 predicted
25-30% slower than they ran); then the options predicted within 5% of the winner
(closer than the model can tell apart).  With none left to try, the provisional plan
keeps its actors.

The plan measured fastest is kept, unless another tried plan measured within 10% of it
(closer than one trial can tell apart): then, of those, the one with the lowest mean of
its measured step time and its prediction from the stages all the trials measured.  On
this 2-core VM a trial's timed steps were further from the same plan measured side by
side later than its prediction was (11 tried plans in 4 runs: the trial off by 2-30%,
mean 15%; the prediction by 0-25%, mean 9%; their mean by 3-28%, mean 11%), so between
near-ties the fastest measured picks noise.  The others' actors stop.  The decision
table shows both predictions and the measured step times, predicted again at the end
with the stages every trial measured.

Note [trial length]
-------------------
A trial's step time is a median over its timed steps, and how many there are decides how
far it can stray.  Three fresh engines of one plan (gpt_auto, ZB-V m=8, 120 steps each,
about 100 ms a step) gave medians over all their steps of 101, 102 and 106 ms; the
medians of consecutive runs of k steps strayed from their engine's by up to: k=5, 12%;
k=10, 10%; k=20, 5%; k=40, 3%.  Spikes (one step of 2.5x in 40) are why it is a median.
So a trial times steps until they fill 2 s, at least 5 and at most 30 (20 at 100 ms; at
1 s a step, 5), and profiles as many as fill 1 s, 4 to 12 (the per-stage means the
correction reads stray the same way).  Fresh actors run their first 5-8 steps up to 1.15x
slower: 6 untimed steps come first.

What no step count removes: fresh processes running one plan stay apart.  Four pipelines
of one plan, side by side for 8 rounds, spread (slowest over fastest median) 1.03-1.44,
mean 1.17, over 17 runs of 3 plans, and a run's two halves ranked them alike.  The slow
one's busy actor spent more user CPU on the same steps (282 against 206 clock ticks),
with no more page faults, threads or niceness.  THP_MEM_ALLOC_ENABLE=1 brought the
spread to 1.02-1.08 but ran 1-23% slower, mean 12% (fresh 2 MB pages faulted in every
step); glibc keeping freed memory (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_)
removed the faults but not the spread (1.26-1.97), and with THP too ran faster but
spread 1.03-1.53 and held 350-450 MB of huge pages per busy actor.  None is set.  So a
trial carries its processes' luck, and near-ties stay within 10% (above).

Note [calibrated tp]
--------------------
With tensor-parallel choices (``Pipeline(tp=(1, 2))``) the controller's decision ranks
every tp, but the trials stay at the tp it chose: the re-plan simulates that tp only
(a trial's runtime terms and corrections belong to its grid; another tp would need
fresh actors on another grid for every comparison), and a trial's stage times are
compared with one TP rank's prediction (``StageCost.on_tp_rank``).  A chosen tp above 1
is not calibrated at all for now: a trial calibrates the links (``pipe.calibrate``), whose
probes refuse a tp > 1 engine (mpmd/profiler/run.py); the controller's plan runs and the
table says so.

Note [size sweep]
-----------------
How a stage's time on the actors grows with its rows is what the controller's timing
gets most wrong, and not always the same way (gpt_auto's head: 0.96x the controller's
time at 4 rows and 1.47x at 16 in one run; its stages 1.1-1.9x at 2 rows and 0.7-1.2x
at 8 in others), and a trial on fresh actors measures it through another process's luck.  So
right after the first trial, the same actors run the same plan at two other microbatch
counts (``trial_at``: ``engine.reschedule``, a trial, the plan back), the counts farthest
in log from those measured.  Their trials correct the model at their own sizes like any
other (``corrected_costs``) and their step times stand with the other trials'.  Measured
(gpt_auto, ZB-V, ms): one set of actors swept to m=2 and m=4 gave the head 34.9 and 15.7
and the step 108.2 and 96.2; fresh engines of those plans, two each, gave the head 30.6
and 36.9, 17.1 and 21.8, the step 102.1 and 108.1, 103.6 and 114.5.  The sweep runs while
the Pipeline is built, before any training: ``reschedule`` starts from the stages' first
state and the RNG states are put back, so it leaves no trace.  Each size costs a trial's
steps and a program shipped, no actor start.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Callable, NamedTuple, Optional, Sequence

from schedules import Costs, Kind, Schedule

from ..runtime import build_schedule
from .a2a import measured_exchanges
from .auto import Decision, Option, choose_schedule
from .costs import RuntimeTerms, StageCost

__all__ = ["Trial", "TrialLength", "trial_at", "corrected_costs", "replan", "decide_on_actors", "stage_pairs"]


class Trial(NamedTuple):
    """What a trial of one plan measured on its actors."""

    costs: Costs  # the calibrated cost model (schedules.Costs with runtime terms)
    step_s: float  # median seconds of the timed ordinary steps
    backwards: tuple[frozenset, ...] = ()  # per stage, the kinds of backward it ran; (): every one fused

    @classmethod
    def of(cls, costs: Costs, step_s: float, ran: Schedule) -> "Trial":
        """A trial that ran the schedule ``ran``."""
        m = range(ran.num_microbatches)
        return cls(costs, step_s, tuple(frozenset(ran.backward_of(s, k) for k in m) for s in range(ran.num_stages)))

    def ran(self, stage: int) -> frozenset:
        """The backward kinds ``stage`` ran: B (fused), I (split: I and W measured apart) or both."""
        return self.backwards[stage] if self.backwards else frozenset({Kind.B})

    @property
    def split(self) -> bool:  # whether some backward ran split (schedules/fuse.py fuses the rest)
        return any(Kind.I in k for k in self.backwards)


@dataclasses.dataclass(frozen=True)
class TrialLength:
    """How many steps a trial runs (Note [trial length]): ``warm`` untimed, then timed and
    profiled steps, each ``(fewest, most, seconds)``: as many as fill ``seconds``."""

    warm: int = 6
    timed: tuple = (5, 30, 2.0)
    profiled: tuple = (4, 12, 1.0)

    def more_timed(self, times: Sequence[float]) -> bool:
        """Whether to run another step after ``times`` (every step's seconds so far)."""
        fewest, most, seconds = self.timed
        done = times[self.warm:]
        return len(done) < most and (len(done) < fewest or sum(done) < seconds)

    def profiled_steps(self, step_s: float) -> int:
        fewest, most, seconds = self.profiled
        return min(most, max(fewest, math.ceil(seconds / step_s)))


def corrected_costs(decision: Decision, trial: Trial, more: Sequence[tuple[Option, Trial]] = ()) -> list[StageCost]:
    """``decision.model_costs`` scaled per stage and kind by what the trials measured over
    what they predicted at their microbatch sizes: ``trial`` a run of ``decision.chosen``,
    ``more`` runs of other options.  Trials at one size give one factor for every size;
    at several sizes, a factor per size, interpolated in log rows between the sizes
    measured and held beyond them (Note [calibrated auto])."""
    runs, sizes = [(decision.chosen, trial), *more], _sizes(decision)
    out = []
    for s, cost in enumerate(decision.model_costs):
        by_rows: dict = {}
        for option, t in runs:
            rows = _rows(decision, option)
            by_rows.setdefault(rows, []).append(_factors(cost, s, option, t, rows, _tp_link(decision)))
        factors = {rows: tuple(statistics.fmean(k) for k in zip(*fs)) for rows, fs in by_rows.items()}
        if len(factors) == 1 or not sizes:
            f, b, w, full = factors[_rows(decision, decision.chosen)]
            out.append(cost.scaled(f=f, b=b, w=w, full=full))
        else:
            out.append(cost.with_curve(sizes, lambda rows, fs=factors: _between(fs, rows)))
    return out


def _factors(cost: StageCost, s: int, option: Option, trial: Trial, rows,
             link: tuple[float, float] = (0.0, math.inf)) -> tuple[float, float, float, float]:
    """Stage ``s``'s measured over predicted ``f, b, w, full`` in ``trial``, a run of ``option``
    (at ``option.tp``: what one TP rank spends, ``StageCost.on_tp_rank``)."""
    p = (cost.at(rows) if rows else cost).on_tp_rank(option.tp, *link)
    extra = p.f if s in option.recompute else 0.0  # a recomputed stage's backward runs its forward again
    mf, mb, mw = (trial.costs.at(k, s) for k in ("f", "b", "w"))
    if Kind.I not in trial.ran(s):  # every backward of the stage fused: its b is the fused B (calibrate.py)
        b = w = full = _ratio(mb, p.full + extra)
    else:
        b, w = _ratio(mb, p.b + extra), _ratio(mw, p.w)
        fused = Kind.B in trial.ran(s) and trial.costs.fused is not None  # else I + W stands for the fused B
        full = _ratio(trial.costs.backward(s), p.full + extra) if fused else _ratio(mb + mw, p.b + p.w + extra)
    return _ratio(mf, p.f), b, w, full


def _between(factors: dict, rows: float) -> tuple[float, ...]:
    """The factors at ``rows``: linear in log rows between the sizes measured, held beyond."""
    xs = sorted(factors)
    if rows <= xs[0] or rows >= xs[-1]:
        return factors[xs[0] if rows <= xs[0] else xs[-1]]
    hi = next(i for i, x in enumerate(xs) if x >= rows)
    x0, x1 = xs[hi - 1], xs[hi]
    t = math.log(rows / x0) / math.log(x1 / x0)
    return tuple(a + (c - a) * t for a, c in zip(factors[x0], factors[x1]))


def replan(decision: Decision, trial: Trial, ran: Schedule, dp: int = 1,
           more: Sequence[tuple[Option, Trial]] = ()) -> Decision:
    """Every option of ``decision`` simulated again with ``corrected_costs`` and the runtime
    terms of ``trial`` (a run of ``decision.chosen`` placed as ``ran``); the options that
    ran (``trial``, and ``more``: other options' trials) carry their measured step times."""
    costs = measured_exchanges(corrected_costs(decision, trial, more), trial.costs, _rows(decision, decision.chosen))
    tp = decision.chosen.tp  # Note [calibrated tp]: the trials' tp only
    params = [sum(costs[s].params_at(tp) for s in ran.stages_of(r)) for r in range(ran.num_ranks)]
    new = choose_schedule(costs, **{**decision.request, "tp": tp}, runtime=RuntimeTerms.from_costs(trial.costs, params, dp))
    for option, t in [(decision.chosen, trial), *more]:
        new = measured(new, option, t.step_s)
    return new


def measured(decision: Decision, option: Option, step_s: float) -> Decision:
    """``decision`` with ``option``'s measured step time recorded."""
    opts = tuple(dataclasses.replace(o, measured_s=step_s) if o.key == option.key else o for o in decision.options)
    return dataclasses.replace(decision, options=opts)


def choosing(decision: Decision, option: Option) -> Decision:
    """``decision`` with ``option`` (one of its options) as the choice."""
    rows = _rows(decision, option)
    costs = [c.at(rows) if rows else c for c in decision.model_costs]
    costs = [c.recomputed() if s in option.recompute else c for s, c in enumerate(costs)]
    return dataclasses.replace(decision, schedule=option.schedule, num_microbatches=option.num_microbatches,
                               num_ranks=option.num_ranks, predicted_step_s=option.step_s,
                               peak_bytes=option.peak_bytes, stage_costs=tuple(costs), recompute=option.recompute,
                               zero=option.zero, tp=option.tp, overlap=option.overlap)


def decide_on_actors(decision: Decision, engine, *, trial: Callable[[object], Trial],
                     make_engine: Callable[[Option], object], dp: int = 1, margin: float = 0.05,
                     max_trials: int = 3, noise: float = 0.10, explore: float = 0.20,
                     sweep: int = 0, measure_at: Optional[Callable[[object, Option], Trial]] = None,
                     progress: Callable[[str], None] = lambda msg: None):
    """Note [calibrated auto]: ``(decision, engine)`` to train with.  ``engine`` runs
    ``decision.chosen``; ``trial(engine)`` measures it and leaves its state as it was;
    ``make_engine(option)`` starts a fresh engine for another option.  After the re-plan,
    the new winner and the options predicted within ``margin`` of it (closer than the
    model can tell apart) run trials too, ``max_trials`` in all; the fastest measured wins,
    or among those measured within ``noise`` of it, the lowest mean of measured and predicted.
    Before the near-ties, an option at a microbatch count no trial runs, predicted within
    ``explore`` of the winner, the count farthest from those tried: one trial's correction
    misleads at other sizes.  ``progress(message)`` hears of each trial as it starts.
    ``measure_at(engine, option)`` (``trial_at``) measures ``option``, the same plan at
    another microbatch count, on ``engine``'s actors and puts them back: after the first
    trial, ``sweep`` such counts correct the model's sizes (Note [size sweep])."""
    first_plan, first_placed = decision.chosen, engine.schedule
    if first_plan.tp > 1:  # Note [calibrated tp]
        return dataclasses.replace(decision, calibration=(
            f"not calibrated on the actors: a trial probes the links, which is not supported at tp={first_plan.tp} "
            f"yet; the controller's plan runs",)), engine
    progress(f"schedule='auto': a trial of {_name(first_plan)} (the controller's choice) on its actors")
    first = trial(engine)
    swept = []
    for option in _sweep_options(decision, first_plan, sweep if measure_at is not None else 0):
        progress(f"schedule='auto': {_name(option)} on the same actors (the model's size dependence)")
        swept.append((option, measure_at(engine, option)))
    new = replan(decision, first, first_placed, dp, more=swept)
    lines = [f"calibrated on the actors: {_name(first_plan)} measured {first.step_s * 1e3:.3f} ms per step; "
             f"predicted {first_plan.step_s * 1e3:.3f} ms by the controller's timing, "
             f"{_option(new, first_plan).step_s * 1e3:.3f} ms by the calibrated model",
             "  per stage, F + backward of one microbatch, ms predicted/measured: "
             + _per_stage(decision, first_plan, first)]
    lines += [f"  on the same actors, {_name(o)}: measured {t.step_s * 1e3:.3f} ms; its stages, controller/measured: "
              + _per_stage(decision, o, t) for o, t in swept]
    best = new.chosen
    fits = [o for o in new.options if o.fits]
    sizes = {first_plan.num_microbatches, best.num_microbatches} | {o.num_microbatches for o, _ in swept}
    # Of those within ``explore``, the count farthest (in log) from every count tried: the most to learn.
    other = sorted((o for o in fits if o.num_microbatches not in sizes and o.step_s <= best.step_s * (1 + explore)),
                   key=lambda o: (-_log_gap(o, sizes), o.step_s))[:1]
    close = [o for o in fits if o.step_s <= best.step_s * (1 + margin)]
    to_try = [o for o in [best] + other + close if o.key != first_plan.key]
    to_try = list({o.key: o for o in to_try}.values())[:max_trials - 1]
    lines.append(f"  re-ranked with the calibrated model: {_name(best)} predicted {best.step_s * 1e3:.3f} ms"
                 + (f"; {len(to_try)} more to try (within {margin:.0%} of it"
                    + (f"; and {other[0].num_microbatches} microbatches, the count farthest from those tried "
                       f"within {explore:.0%}" if other else "") + ")"
                    if to_try else ", stays"))
    if not to_try:
        return dataclasses.replace(new, calibration=tuple(lines), provisional=decision), engine
    running, tried = first_plan, list(swept)
    for i, option in enumerate(to_try):
        progress(f"schedule='auto': trial {i + 2} of {len(to_try) + 1}, {_name(option)} "
                 f"(predicted {option.step_s * 1e3:.1f} ms), on fresh actors")
        engine.shutdown()
        engine, running = make_engine(option), option
        try:
            got = trial(engine)
        except BaseException:
            engine.shutdown()
            raise
        tried.append((option, got))
        lines.append(f"  tried {_name(option)}: predicted {option.step_s * 1e3:.3f} ms, measured "
                     f"{got.step_s * 1e3:.3f} ms; its stages, calibrated prediction/measured: "
                     + _per_stage(new, option, got))  # new.model_costs: corrected by the first trial
    # Every trial corrects the stages at its own microbatch size; the table is predicted again from all of them.
    new = replan(decision, first, first_placed, dp, more=tried)  # every option that ran carries its measured time
    ran = {o.key: o for o in new.options if o.measured_s is not None}
    quickest = min(o.measured_s for o in ran.values())
    both = {k: (o.measured_s + o.step_s) / 2 for k, o in ran.items() if o.measured_s <= quickest * (1 + noise)}
    fastest = ran[min(both, key=both.get)]
    lines.append(f"  kept {_name(fastest)}: measured {fastest.measured_s * 1e3:.3f} ms, predicted from the stages "
                 f"all {len(tried) + 1} trials measured {fastest.step_s * 1e3:.3f} ms"
                 + (f"; of the {len(both)} measured within {noise:.0%} of the fastest, the lowest mean of the two"
                    if len(both) > 1 else "; measured fastest"))
    if fastest.key != running.key:
        engine.shutdown()
        engine = make_engine(fastest)
    return dataclasses.replace(choosing(new, fastest), calibration=tuple(lines), provisional=decision), engine


def _sweep_options(decision: Decision, option: Option, count: int) -> list[Option]:
    """Up to ``count`` options running ``option``'s plan at other microbatch counts, each the
    count farthest (in log) from those already chosen (Note [size sweep])."""
    same = [o for o in decision.options if o.fits and o.schedule == option.schedule
            and o.num_ranks == option.num_ranks and o.recompute == option.recompute and o.zero == option.zero
            and o.tp == option.tp]  # the same actors: the same grid
    chosen: list[Option] = []
    for _ in range(count):
        counts = {option.num_microbatches} | {o.num_microbatches for o in chosen}
        rest = [o for o in same if o.num_microbatches not in counts]
        if not rest:
            break
        chosen.append(max(rest, key=lambda o: _log_gap(o, counts)))
    return chosen


def _log_gap(option: Option, counts) -> float:
    """How far (in log) ``option``'s microbatch count is from the nearest of ``counts``."""
    return min(abs(math.log(option.num_microbatches / m)) for m in counts)


def trial_at(engine, option: Option, trial: Callable[[object], Trial]) -> Trial:
    """Note [size sweep]: ``trial(engine)`` with ``engine``'s actors running ``option`` (its
    plan at another microbatch count), then the actors back on the plan they ran, from the
    stages' first state, and their RNG states as they were: a trial taken while the Pipeline
    is built, before any training, leaves no trace (``trial`` need not restore the state)."""
    schedule, config, batching = engine.schedule, engine.config, engine.batching
    rng = engine.client.rng_states()
    other = build_schedule(option.schedule, schedule.num_stages, config, option.num_microbatches)
    engine.reschedule(other, config, batching)
    try:
        return trial(engine)
    finally:
        engine.reschedule(schedule, config, batching)
        engine.client.set_rng_states(rng)


def stage_pairs(decision: Decision, option: Option, trial: Trial) -> list[tuple[float, float]]:
    """Per stage, ``(predicted, measured)`` seconds of F plus the backward of one microbatch:
    ``decision.model_costs`` at ``option``'s microbatch size against ``trial``, a run of ``option``."""
    rows = _rows(decision, option)
    out = []
    for s, cost in enumerate(decision.model_costs):
        p = (cost.at(rows) if rows else cost).on_tp_rank(option.tp, *_tp_link(decision))
        p = p.recomputed() if s in option.recompute else p
        out.append((p.f + (p.b + p.w if Kind.I in trial.ran(s) else p.full),
                    trial.costs.at("f", s) + trial.costs.at("b", s) + trial.costs.at("w", s)))
    return out


def _per_stage(decision: Decision, option: Option, trial: Trial) -> str:
    return "; ".join(f"{s}: {p * 1e3:.3f}/{m * 1e3:.3f} ({m / p if p > 0 else float('nan'):.2f})"
                     for s, (p, m) in enumerate(stage_pairs(decision, option, trial)))


def _option(decision: Decision, option: Option) -> Option:
    return next(o for o in decision.options if o.key == option.key)


def _rows(decision: Decision, option: Option):
    return decision.request["batch_size"] / option.num_microbatches if decision.request.get("batch_size") else None


def _sizes(decision: Decision) -> list[float]:
    """The microbatch sizes (rows) of the decision's candidate counts; none without a batch size."""
    batch = decision.request.get("batch_size")
    return [batch / m for m in decision.request.get("microbatches") or ()] if batch else []


def _tp_link(decision: Decision) -> tuple[float, float]:
    """The TP all-reduce's latency and bandwidth the decision was simulated with."""
    return decision.request.get("tp_latency_s", 0.0), decision.request.get("tp_bytes_per_s", math.inf)


def _ratio(measured: float, predicted: float) -> float:
    return measured / predicted if predicted > 0 and measured > 0 else 1.0


def _name(o: Option) -> str:
    return (f"{o.schedule} m={o.num_microbatches} on {o.num_ranks} actors" + (f" x tp={o.tp}" if o.tp > 1 else "")
            + (f" recomputing {','.join(map(str, o.recompute))}" if o.recompute else "") + (" overlapped" if o.overlap else ""))

