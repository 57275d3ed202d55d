"""Note [calibrated auto]: the re-plan from a trial on the actors (pure, with stand-in
engines and trials), and a Pipeline whose trial leaves no trace in training."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import mpmd
import schedules
from mpmd.planning import StageCost, choose_schedule
from mpmd.planning.costs import RuntimeTerms
from mpmd.planning.replan import Trial, TrialLength, corrected_costs, decide_on_actors, replan, stage_pairs
from mpmd.runtime import PipelineConfig, build_schedule

from tests.models import assert_trained_like_reference, make_data, make_stages, sgd

mse = torch.nn.functional.mse_loss
MS = [1, 2, 4, 8]
# Two stages, 8 rows per step; the controller's model: time proportional to rows, no fixed part.
MODEL = [StageCost(f=8e-3, b=16e-3, w=0.0, rows=8, out_bytes=8000, param_bytes=4000),
         StageCost(f=8e-3, b=16e-3, w=0.0, rows=8, param_bytes=4000)]


def _decision():
    return choose_schedule(MODEL, memory_limit_bytes=1 << 30, batch_size=8, microbatches=MS,
                           schedule_names=["1f1b", "gpipe"], num_ranks=2)


def _one_schedule():
    return choose_schedule(MODEL, memory_limit_bytes=1 << 30, batch_size=8, microbatches=MS, schedule_names=["1f1b"],
                           num_ranks=2)


def _trial(option, *, f_scale=(1.0, 1.0), task=0.0, step_s=0.05) -> Trial:
    """What a run of ``option`` measures: the model's costs at its microbatch size, stage
    s's forward times ``f_scale[s]``, and ``task`` seconds per instruction."""
    rows = 8 / option.num_microbatches
    at = [c.at(rows) for c in MODEL]
    return Trial(schedules.Costs(f=[c.f * k for c, k in zip(at, f_scale)], b=[c.full for c in at], w=0.0, task=task,
                                 message=task),
                 step_s)


def _placed(option):
    return build_schedule(option.schedule, 2, PipelineConfig.from_options(num_actors=option.num_ranks),
                          option.num_microbatches)


def test_without_runtime_costs_more_microbatches_win():
    assert _decision().num_microbatches == 8  # a smaller bubble, nothing charged per microbatch


def test_corrected_costs_scale_the_model_by_what_the_trial_measured():
    d = _decision()
    fixed = corrected_costs(d, _trial(d.chosen, f_scale=(1.0, 3.0)))
    assert fixed[0] == MODEL[0]
    for rows in (1, 4, 8):  # every microbatch size, not only the trial's
        assert fixed[1].at(rows).f == pytest.approx(3 * MODEL[1].at(rows).f)
        assert fixed[1].at(rows).full == pytest.approx(MODEL[1].at(rows).full)
    # Per stage F + B at the trial's size (1 row): stage 1 predicted 1 + 2 ms, measured 3 + 2 ms.
    pairs = stage_pairs(d, d.chosen, _trial(d.chosen, f_scale=(1.0, 3.0)))
    assert [m / p for p, m in pairs] == pytest.approx([1.0, 5 / 3])


def test_trials_at_two_sizes_correct_each_size():
    """Once trials ran at 1 and 4 rows, each size has its own factor: stage 1's forward took
    2x the model at 1 row and 4x at 4 rows; 3x at 2 rows (halfway in log rows), 4x beyond."""
    d = _decision()
    other = next(o for o in d.options if o.num_microbatches == 2)  # 4 rows; the chosen plan has 8 microbatches of 1
    fixed = corrected_costs(d, _trial(d.chosen, f_scale=(1.0, 2.0)), more=[(other, _trial(other, f_scale=(1.0, 4.0)))])
    for rows, k in ((1, 2.0), (2, 3.0), (4, 4.0), (8, 4.0)):
        assert fixed[1].at(rows).f == pytest.approx(k * MODEL[1].at(rows).f)
        assert fixed[1].at(rows).full == pytest.approx(MODEL[1].at(rows).full)
        assert fixed[0].at(rows).f == pytest.approx(MODEL[0].at(rows).f)


def test_a_split_trial_corrects_the_fused_backward_by_the_fused_ones_it_ran():
    """A named split schedule runs some backwards fused (schedules/fuse.py): the trial's
    calibrated ``Costs.fused`` corrects the model's fused cost; without it, I + W does."""
    model = [StageCost(f=8e-3, b=10e-3, w=6e-3, full=14e-3, rows=8, out_bytes=8000, param_bytes=4000),
             StageCost(f=8e-3, b=10e-3, w=6e-3, full=14e-3, rows=8, param_bytes=4000)]
    d = choose_schedule(model, memory_limit_bytes=1 << 30, batch_size=8, microbatches=[8], schedule_names=["zb-h1"],
                        num_ranks=2)
    at = [c.at(1) for c in model]

    def trial(fused):  # each stage ran some backwards split and some fused
        return Trial(schedules.Costs(f=[c.f for c in at], b=[c.b for c in at], w=[c.w for c in at], fused=fused),
                     0.05, backwards=(frozenset({schedules.Kind.I, schedules.Kind.B}),) * 2)

    ran = corrected_costs(d, trial([1.5 * c.full for c in at]))  # its Bs took 1.5x the model's
    assert [c.full for c in ran] == pytest.approx([1.5 * c.full for c in model])
    assert [x for c in ran for x in (c.b, c.w)] == pytest.approx([x for c in model for x in (c.b, c.w)])
    assert [c.full for c in corrected_costs(d, trial(None))] == pytest.approx([c.full for c in model])


def test_a_stage_that_ran_only_fused_backwards_scales_its_split_by_them():
    """zb-h1 at p=2 as a Pipeline runs it: stage 0 fuses every backward, stage 1 splits every
    one.  Calibration gives stage 0 ``b`` = its measured B and ``w`` = 0 (calibrate.py), so its
    I, W and fused costs all scale by B over the model's fused cost, not I by B over I."""
    model = [StageCost(f=8e-3, b=10e-3, w=6e-3, full=14e-3, rows=8, out_bytes=8000, param_bytes=4000),
             StageCost(f=8e-3, b=10e-3, w=6e-3, full=14e-3, rows=8, param_bytes=4000)]
    d = choose_schedule(model, memory_limit_bytes=1 << 30, batch_size=8, microbatches=[8], schedule_names=["zb-h1"],
                        num_ranks=2)
    at = [c.at(1) for c in model]
    costs = schedules.Costs(f=[c.f for c in at], b=[1.5 * at[0].full, 2 * at[1].b], w=[0.0, at[1].w],
                            fused=[1.5 * at[0].full, 2 * at[1].b + at[1].w])
    trial = Trial.of(costs, 0.05, _placed(d.chosen))
    assert trial.split and trial.ran(0) == {schedules.Kind.B} and trial.ran(1) == {schedules.Kind.I}
    fixed = corrected_costs(d, trial)
    assert (fixed[0].b, fixed[0].w, fixed[0].full) == pytest.approx((15e-3, 9e-3, 21e-3))
    # Stage 1 ran no B: its fused cost scales as its I + W did (20 + 6 against 10 + 6).
    assert (fixed[1].b, fixed[1].w, fixed[1].full) == pytest.approx((20e-3, 6e-3, 14e-3 * 26 / 16))
    # Per stage F + backward: stage 0 predicted F + fused B, measured F + its B.
    assert [m / p for p, m in stage_pairs(d, d.chosen, trial)] == pytest.approx([(1 + 1.5 * 1.75) / 2.75, 4.25 / 3])


def test_a_cost_per_task_moves_the_plan_to_fewer_microbatches():
    d = _decision()
    new = replan(d, _trial(d.chosen, task=4e-3), _placed(d.chosen))
    assert new.num_microbatches < 8
    provisional = next(o for o in new.options if o.key == d.chosen.key)
    assert provisional.measured_s == 0.05 and provisional.step_s > new.predicted_step_s
    # The simulation charges what the terms say: the same plan, more tasks, a longer step.
    terms = RuntimeTerms(task=4e-3)
    few, many = (terms.simulate(schedules.get_schedule("1f1b", 2, m), [c.at(8 / m) for c in MODEL], False).step_time
                 for m in (2, 8))
    assert many > few
    # With replicas, every stage's all-reduce is charged to its rank: one more task and its latency.
    sched, at = schedules.get_schedule("1f1b", 2, 2), [c.at(4) for c in MODEL]
    alone = RuntimeTerms(task=1e-4).simulate(sched, at, False).step_time
    assert RuntimeTerms(task=1e-4, dp=2, allreduce_latency=5e-3).simulate(sched, at, False).step_time == \
        pytest.approx(alone + 1e-4 + 5e-3, rel=1e-6)


class _Engine:
    """A stand-in engine running one option."""

    def __init__(self, option, log):
        self.option, self.schedule, self.log, self.closed = option, _placed(option), log, False
        log.append(("start", option.num_microbatches))

    def shutdown(self):
        self.closed = True
        self.log.append(("stop", self.option.num_microbatches))


@pytest.mark.parametrize("fast_m", [8, 2, 1])
def test_the_plan_measured_much_fastest_is_kept(fast_m):
    """The re-plan's winner and the options within 5% of it are tried (3 trials at most):
    a plan measured 5x faster than the others trains, on the only engine left running;
    between plans measured within 10%, the lowest mean of measured and predicted."""
    d, log, engines = _decision(), [], []

    def start(option):
        engines.append(_Engine(option, log))
        return engines[-1]

    def trial(engine):  # fast_m measures 10 ms, every other plan 50 ms and more; stage 1's F grows with m
        o = engine.option
        return _trial(o, task=4e-3, f_scale=(1.0, 1 + o.num_microbatches / 4), step_s=0.01 if o.num_microbatches == fast_m else
                      0.05 + 1e-3 * o.num_microbatches + 1e-4 * (o.schedule == "gpipe"))

    first = _Engine(d.chosen, log)
    engines.append(first)
    said: list = []
    decision, engine = decide_on_actors(d, first, trial=trial, make_engine=start, progress=said.append)
    tried = {o.key: o.measured_s for o in decision.options if o.measured_s is not None}
    assert len(said) == len(tried) and all(m.startswith("schedule='auto': ") for m in said)  # one line a trial
    assert 2 <= len(tried) <= 3 and d.chosen.key in tried  # the provisional plan and the re-plan's winner at least
    near = {o.key: o.measured_s + o.step_s for o in decision.options if o.key in tried
            and o.measured_s <= 1.1 * min(tried.values())}
    best = min(near, key=near.get)
    assert decision.chosen.key == best == engine.option.key and not engine.closed
    assert all(e.closed for e in engines if e is not engine)
    if fast_m in {o.num_microbatches for o in decision.options if o.key in tried}:
        assert decision.num_microbatches == fast_m and decision.chosen.measured_s == 0.01
    # A fresh engine for the winner only when it is not the one tried last.
    restarted = engines[-1].option.key == engines[len(tried) - 1].option.key
    assert len(engines) == len(tried) + (0 if restarted else 1)
    text = decision.table()
    assert "measured" in text and "calibrated on the actors" in text and f"kept {decision.schedule}" in text
    # The kept plan's stages are what its own trial measured, whichever trial came first.
    m = decision.num_microbatches
    assert [c.f for c in decision.stage_costs] == pytest.approx([MODEL[0].at(8 / m).f,
                                                                 (1 + m / 4) * MODEL[1].at(8 / m).f])


@pytest.mark.parametrize("m1_ms, kept", [(52.0, 1), (60.0, 8)])
def test_trials_closer_than_their_noise_are_told_apart_by_the_prediction(m1_ms, kept):
    """m=8 measured 50 ms but is predicted at 319 ms with the trial's per-task cost; m=1 is
    predicted at 94 ms.  Measured 52 ms (within 10%), m=1 trains; measured 60 ms, m=8 does."""
    d = _one_schedule()
    step = {8: 0.050, 1: m1_ms / 1e3, 2: 0.080}
    decision, engine = decide_on_actors(d, _Engine(d.chosen, []), margin=10.0,
                                        trial=lambda e: _trial(e.option, task=4e-3, step_s=step[e.option.num_microbatches]),
                                        make_engine=lambda o: _Engine(o, []))
    assert sorted(o.num_microbatches for o in decision.options if o.measured_s is not None) == [1, 2, 8]
    assert decision.num_microbatches == kept == engine.option.num_microbatches
    assert ("the lowest mean of the two" in decision.table()) == (kept == 1)


def test_without_near_ties_one_more_trial():
    d = _one_schedule()
    log = []
    decision, engine = decide_on_actors(d, _Engine(d.chosen, log),
                                        trial=lambda e: _trial(e.option, task=4e-3,
                                                               step_s=0.05 if e.option.num_microbatches == 8 else 0.04),
                                        make_engine=lambda o: _Engine(o, log), margin=0.0, explore=0.0)
    assert [m for what, m in log if what == "start"] == [8, decision.num_microbatches] and engine.option.key == \
        decision.chosen.key
    assert sum(o.measured_s is not None for o in decision.options) == 2


@pytest.mark.parametrize("explore, started", [(0.2, [8, 1, 2]), (0.15, [8, 1])])
def test_a_trial_at_another_microbatch_count_before_the_near_ties(explore, started):
    """A per-task cost moves the plan from m=8 to m=1 (predicted 92 ms); m=2 is predicted at
    108 ms (17% slower) and m=4 slower still: m=2 runs a trial too when within ``explore``."""
    d, log = _one_schedule(), []
    decide_on_actors(d, _Engine(d.chosen, log), trial=lambda e: _trial(e.option, task=4e-3),
                     make_engine=lambda o: _Engine(o, log), margin=0.0, explore=explore)
    assert [m for what, m in log if what == "start"][:len(started)] == started
    assert len([1 for what, _ in log if what == "start"]) <= len(started) + 1  # + a restart of the winner


def test_a_sweep_measures_the_same_plan_at_other_sizes_on_the_same_actors():
    """Note [size sweep]: after the first trial (m=8), the same plan at the counts farthest
    from those measured (1, then 2 or 4) runs on the first engine, not on fresh actors, and
    its trials correct the model at their own sizes: stage 1's forward measured 3x at 8 rows."""
    d, log, swept = _one_schedule(), [], []
    first = _Engine(d.chosen, log)

    def measure_at(engine, option):
        swept.append((engine, option.num_microbatches))
        return _trial(option, task=4e-3, f_scale=(1.0, 3.0 if option.num_microbatches == 1 else 1.0))

    decision, _ = decide_on_actors(d, first, trial=lambda e: _trial(e.option, task=4e-3), sweep=2,
                                   measure_at=measure_at, make_engine=lambda o: _Engine(o, log), margin=0.0,
                                   explore=0.0, max_trials=1)
    assert [e for e, _ in swept] == [first, first] and swept[0][1] == 1 and swept[1][1] in (2, 4)
    assert log == [("start", 8)] or log[:2] == [("start", 8), ("stop", 8)]  # no engine started for the sweep
    assert decision.model_costs[1].at(8).f == pytest.approx(3.0 * MODEL[1].at(8).f)
    assert decision.model_costs[0].at(8).f == pytest.approx(MODEL[0].at(8).f)
    assert "on the same actors" in decision.table()
    # Without measure_at (a caller that cannot reschedule its engine) nothing is swept.
    plain, _ = decide_on_actors(d, _Engine(d.chosen, []), trial=lambda e: _trial(e.option, task=4e-3), sweep=2,
                                make_engine=lambda o: _Engine(o, []), margin=0.0, explore=0.0, max_trials=1)
    assert plain.model_costs[1].at(8).f == pytest.approx(MODEL[1].at(8).f)


def test_the_provisional_plan_stays_on_its_actors_when_it_still_wins():
    """No option within 1% of it (1F1B alone: more microbatches, a smaller bubble)."""
    d, log = _one_schedule(), []
    first = _Engine(d.chosen, log)
    decision, engine = decide_on_actors(d, first, trial=lambda e: _trial(e.option),
                                        make_engine=lambda o: _Engine(o, log), margin=0.01, explore=0.0)
    assert engine is first and not first.closed and log == [("start", 8)]
    assert decision.chosen.key == d.chosen.key and decision.chosen.measured_s == 0.05
    assert "stays" in decision.table()


def test_the_trial_leaves_no_trace_and_errors(ray_session, capsys):
    """The trial runs real steps (SGD would move the parameters); training then equals the
    reference from the initial state, and the table shows the measured step time."""
    stages, data = make_stages(2), make_data(steps=2, batch=8)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches="auto", sample=data[0], loss_fn=mse, optimizer=sgd,
                       device="cpu", memory_limit_bytes=1 << 30, num_actors=2) as pipe:
        d = pipe.auto_decision
        assert d.chosen.measured_s is not None and d.calibration
        out = capsys.readouterr().out
        assert "calibrated on the actors" in out and "schedule='auto': a trial of 1f1b" in out  # progress, then the table
        assert "on the same actors (the model's size dependence)" in out  # the sweep ran, and left no trace either
        losses = [pipe.step(x, y) for x, y in data]
        got = list(pipe.state_dict().values())
    assert_trained_like_reference(losses, got, stages, data, d.num_microbatches, mse, sgd)
    with pytest.raises(ValueError, match="auto_calibrate must be True or False"):
        mpmd.Pipeline(stages, schedule="auto", sample=data[0], loss_fn=mse, auto_calibrate="yes", device="cpu")


def test_auto_report_compares_the_choice_with_the_fastest_measured():
    from benchmarks.bench_auto import auto_report, copy_key

    d = _decision()
    def faster(engine):
        return _trial(engine.option, task=4e-3, step_s=0.05 if engine.option.num_microbatches == 8 else 0.04)

    decision, _ = decide_on_actors(d, _Engine(d.chosen, []), trial=faster, make_engine=lambda o: _Engine(o, []))
    assert decision.chosen.key != decision.provisional.chosen.key
    others = [o for o in decision.options if o.key != decision.chosen.key][:2]
    measured = {decision.chosen.key: [0.021, 0.020, 0.022], others[0].key: [0.010], others[1].key: [0.030]}
    text = "\n".join(auto_report(decision, measured))
    assert "auto's choice measured 21.0 ms: 2.100x the fastest measured option" in text
    assert f"({others[0].schedule} m={others[0].num_microbatches}, 10.0 ms)" in text
    assert "the controller-only choice measured" not in text  # not measured here
    measured[decision.provisional.chosen.key] = [0.040]
    measured[copy_key(decision.chosen.key)] = [0.024]  # the same plan in a second pipeline: not an option of its own
    text = "\n".join(auto_report(decision, measured))
    assert "the controller-only choice measured 40.0 ms: 4.000x the fastest" in text
    assert "noise floor: auto's choice in a second pipeline measured 24.0 ms, 1.143x apart" in text
    assert "auto's choice measured 21.0 ms: 2.100x the fastest measured option" in text
    marks = {line.split()[0]: line.split()[1:3] for line in text.splitlines() if line[:1] in ("*", "p")}
    assert marks == {"*": [decision.schedule, str(decision.num_ranks)],
                     "p": [decision.provisional.schedule, str(decision.provisional.num_ranks)]}


def test_a_trial_times_steps_until_they_fill_its_seconds_within_its_bounds():
    length = TrialLength(warm=2, timed=(5, 30, 2.0), profiled=(4, 12, 1.0))

    def timed(step_s):
        times = []
        while length.more_timed(times):
            times.append(step_s)
        return len(times) - length.warm

    assert timed(0.125) == 16  # 2 s of 125 ms steps
    assert timed(1.0) == 5  # the fewest, though 2 s are filled after 2
    assert timed(0.01) == 30  # the most, though 2 s need 200
    assert [length.profiled_steps(s) for s in (0.125, 0.5, 0.001)] == [8, 4, 12]


def test_the_replan_keeps_zero_1_where_only_it_fits_and_charges_its_gather():
    """dp=2, zero not given, a limit only sharded optimizer state meets: the re-plan from a trial
    (the same request) still chooses zero=1, the sweep stays on zero=1 plans (its actors run
    zero=1), and the calibrated simulation charges the all-gather after the step (Costs.zero)."""
    mine = dict(batch_size=8, microbatches=MS, schedule_names=["1f1b"], num_ranks=2, dp=2, zero=None)
    free = choose_schedule(MODEL, memory_limit_bytes=1 << 30, **mine)
    d = choose_schedule(MODEL, memory_limit_bytes=min(o.peak_bytes for o in free.options) - 1, **mine)
    assert d.zero == 1 and d.recompute == ()
    swept = []

    def trial(option):
        base = _trial(option, task=4e-3)
        return Trial(dataclasses.replace(base.costs, dp=2, allreduce_bandwidth=1e6, zero=1), base.step_s)

    def measure_at(engine, option):
        swept.append(option)
        return trial(option)

    new, _ = decide_on_actors(d, _Engine(d.chosen, []), trial=lambda e: trial(e.option), sweep=2, dp=2,
                              measure_at=measure_at, make_engine=lambda o: _Engine(o, []), margin=0.0, explore=0.0,
                              max_trials=1)
    assert new.zero == 1 and new.chosen.fits and swept and all(o.zero == 1 for o in swept)
    terms = RuntimeTerms(dp=2, allreduce_bandwidth=1e6)
    sched, costs = _placed(d.chosen), [c.at(8 / d.num_microbatches) for c in MODEL]
    gathered = dataclasses.replace(terms, zero=1).simulate(sched, costs, False).step_time
    assert gathered > terms.simulate(sched, costs, False).step_time  # 4000 B over 1 MB/s after the step
    assert d.chosen.applied(PipelineConfig.from_options(dp=2)).layout.zero == 1
