"""schedule="auto": the pure decision against the simulator, memory limits, measuring, and a
Pipeline that chooses its own schedule."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
from torch import nn

import mpmd
import schedules
from mpmd.planning import StageCost, choose_schedule, measure_module, plan_pipeline
from mpmd.planning.measure import Measurement
from mpmd.runtime import PipelineConfig

from tests.models import assert_trained_like_reference, make_data, make_stages, sgd


mse = torch.nn.functional.mse_loss

# A heterogeneous 4-stage model: a cheap first stage, a heavy last one.
COSTS = [StageCost(f=1.0, b=0.5, w=0.5, act_bytes=100, param_bytes=40),
         StageCost(f=2.0, b=2.0, w=1.0, act_bytes=300, param_bytes=200),
         StageCost(f=2.0, b=2.0, w=1.0, act_bytes=300, param_bytes=200),
         StageCost(f=3.0, b=3.0, w=2.0, act_bytes=500, param_bytes=800)]
MS = [2, 4, 8]


def _simulator_ranking(costs, ms):
    """Every registered schedule (but terapipe) at its default placement, as the Pipeline runs it
    (free split backwards fused, schedules/fuse.py), by simulated makespan."""
    sim_costs = schedules.Costs(f=[c.f for c in costs], b=[c.b for c in costs], w=[c.w for c in costs])
    ranked = []
    for name in schedules.schedule_names():
        if name == "terapipe":
            continue
        per = schedules.schedule_info(name).default_stages_per_rank
        for m in ms:
            try:
                s = schedules.fuse_backwards(schedules.get_schedule(name, len(costs) // per, m, per))
            except ValueError:
                continue
            ranked.append((schedules.simulate(s, sim_costs).makespan, name, m))
    return sorted(ranked)


def test_auto_picks_the_schedule_the_simulator_ranks_best():
    d = choose_schedule(COSTS, memory_limit_bytes=1e9, microbatches=MS)
    ranked = _simulator_ranking(COSTS, MS)
    assert d.predicted_step_s == pytest.approx(ranked[0][0])
    assert (d.predicted_step_s, d.schedule, d.num_microbatches) in [r for r in ranked if r[0] == ranked[0][0]]
    assert len(d.options) == len(ranked)
    assert [o.step_s for o in d.options] == pytest.approx(sorted(r[0] for r in ranked))
    assert d.chosen.fits and "chose" in d.table() and d.schedule in d.table()


def test_auto_respects_the_memory_limit():
    free = choose_schedule(COSTS, memory_limit_bytes=1e9, microbatches=MS)
    limit = free.peak_bytes - 1  # the unconstrained winner no longer fits
    d = choose_schedule(COSTS, memory_limit_bytes=limit, microbatches=MS)
    assert d.peak_bytes <= limit and d.predicted_step_s >= free.predicted_step_s
    faster = [o for o in d.options if o.step_s < d.predicted_step_s]
    assert faster and all(o.peak_bytes > limit for o in faster)


def test_memory_estimate_of_1f1b():
    d = choose_schedule(COSTS, memory_limit_bytes=1e9, microbatches=[8], schedule_names=["1f1b", "gpipe"])
    peaks = {o.schedule: o.peak_bytes for o in d.options}
    # params x (param + grad + 2 Adam states) plus live activations: 1F1B's last rank holds one
    # microbatch, GPipe's holds all 8; the busiest actor decides.
    assert peaks["1f1b"] == max(4 * 40 + 4 * 100, 4 * 200 + 3 * 300, 4 * 200 + 2 * 300, 4 * 800 + 500)
    assert peaks["gpipe"] == 4 * 800 + 8 * 500


def test_memory_estimate_counts_what_a_split_backward_holds_from_i_to_w():
    seeded = [dataclasses.replace(c, seed_bytes=10_000) for c in COSTS]
    names = ["1f1b", "zb-h1"]

    def peaks(costs):
        d = choose_schedule(costs, memory_limit_bytes=1e9, microbatches=[8], schedule_names=names)
        return {o.schedule: o.peak_bytes for o in d.options}

    plain, held = peaks(COSTS), peaks(seeded)
    assert held["1f1b"] == plain["1f1b"]  # a fused backward holds no seeds
    # Every rank of ZB-H1 holds at least one microbatch's seeds between its I and W.
    assert held["zb-h1"] >= plain["zb-h1"] + 10_000


def test_too_small_a_limit_raises_with_the_smallest_need():
    # Nothing fits even recomputing every stage: the error gives the least any option needs.
    need = min(o.peak_bytes for o in choose_schedule(COSTS, memory_limit_bytes=1e9, microbatches=MS,
                                                     recompute=True).options)
    with pytest.raises(ValueError, match=r"no schedule fits memory_limit_bytes=1,000 .*needs ([\d,]+) bytes") as e:
        choose_schedule(COSTS, memory_limit_bytes=1000, microbatches=MS)
    assert int(re.search(r"needs ([\d,]+) bytes", str(e.value)).group(1).replace(",", "")) == need
    assert f"at least {int(need)}," in str(e.value)


def test_auto_recomputes_only_when_nothing_fits_without_it():
    # equal activations: the first ranks of 1F1B hold the most microbatches, which recompute cuts
    costs = [dataclasses.replace(c, in_bytes=10, out_bytes=10, act_bytes=300, param_bytes=40) for c in COSTS]
    free = choose_schedule(costs, memory_limit_bytes=1e9, microbatches=MS)
    assert free.recompute == () and all(not o.recompute for o in free.options)
    tightest = min(o.peak_bytes for o in free.options)
    tight = choose_schedule(costs, memory_limit_bytes=tightest - 1, microbatches=MS)
    assert tight.recompute == (0, 1, 2, 3) and tight.chosen.fits
    # The recomputed stage holds its input and output only, and its backward runs the forward again.
    assert tight.stage_costs[1].act_bytes == 20 and tight.stage_costs[1].b == COSTS[1].b + COSTS[1].f
    assert "recomputing stages 0,1,2,3" in tight.table() and "recompute 0,1,2,3" in tight.table()
    assert choose_schedule(costs, memory_limit_bytes=1e9, microbatches=MS, recompute=[1]).recompute == (1,)


@pytest.mark.parametrize("schedule", ["gpipe", "zb-h1"])
def test_a_recomputed_stage_holds_its_recomputed_activations_through_its_backward(schedule):
    """Recompute keeps a microbatch's input and output until its backward, which runs the forward
    again and holds what it saves: for the length of B, or from I to W under a split backward
    (Note [recompute at I]).  Two stages on two actors, two microbatches, 160 bytes of parameter
    state each.  GPipe: an actor holds both microbatches' input and output (2 x 20) and, in its
    first backward, one recomputed forward's activations (300).  ZB-H1's second actor runs F I F I
    W W: both microbatches' recomputed activations and seeds (2 x 305) wait for their W.  Each
    actor also holds the receive it posts ahead (10: Note [receive prefetch])."""
    costs = [StageCost(f=1.0, b=1.0, w=1.0, act_bytes=300, in_bytes=10, out_bytes=10, param_bytes=40, seed_bytes=5)
             for _ in range(2)]
    d = choose_schedule(costs, memory_limit_bytes=1e9, microbatches=[2], schedule_names=[schedule], recompute=[0, 1])
    held = 2 * 20 + 300 if schedule == "gpipe" else 2 * 20 + 2 * (300 + 5)
    assert d.chosen.peak_bytes == 40 * (2 + 2) + held + 10


def test_auto_chooses_zero_1_only_when_only_sharded_state_fits():
    # the first rank holds the most parameters and, in 1F1B, the most microbatches (which recompute cuts)
    costs = [dataclasses.replace(c, act_bytes=300, in_bytes=10, out_bytes=10, param_bytes=p)
             for c, p in zip(COSTS, (800, 200, 200, 40))]
    free = choose_schedule(costs, memory_limit_bytes=1e9, microbatches=MS, dp=2, zero=None)
    assert free.zero == 0 and all(o.zero == 0 for o in free.options) and "zero=1" not in free.table()
    tightest = min(o.peak_bytes for o in free.options)
    d = choose_schedule(costs, memory_limit_bytes=tightest - 1, microbatches=MS, dp=2, zero=None)
    assert d.zero == d.chosen.zero == 1 and d.recompute == () and d.chosen.fits  # before recompute
    assert {o.zero for o in d.options} == {0, 1}  # the table keeps what did not fit
    one = next(o for o in d.options if (o.schedule, o.num_microbatches, o.zero) == ("1f1b", 8, 1))
    # the busiest rank: params, grads, half of 2 states, 4 microbatches, the gradient it posts a receive for
    assert one.peak_bytes == 800 * (2 + 2 / 2) + 4 * 300 + 10
    assert "and zero=1: it fits only with the optimizer state split over the dp=2 replicas" in d.table()
    assert d.chosen.applied(PipelineConfig.from_options(dp=2, memory_limit_bytes=1)).layout.zero == 1
    # zero pinned, or one replica: never chosen (recompute instead); pinned zero=1 is no choice to announce.
    for pinned in (dict(dp=2, zero=0), dict(dp=1, zero=None)):
        other = choose_schedule(costs, memory_limit_bytes=tightest - 1, microbatches=MS, **pinned)
        assert other.zero == 0 and other.recompute == (0, 1, 2, 3)
    both = choose_schedule(costs, memory_limit_bytes=tightest - 1, microbatches=MS, dp=2, zero=1)
    assert all(o.zero == 1 for o in both.options) and "zero=1: it fits" not in both.table()
    with pytest.raises(ValueError, match=r"or pass zero=1 with dp > 1"):
        choose_schedule(costs, memory_limit_bytes=1000, microbatches=MS)


def test_microbatch_counts_scale_the_costs():
    # Per-row costs with a fixed part: more microbatches shrink the bubble but pay the fixed part more often.
    c = StageCost(f=1.0, b=1.0, w=1.0, rows=16, f0=0.25, b0=0.25, w0=0.25, act_bytes=1600)
    half = c.at(8)
    assert (half.f, half.b, half.full, half.act_bytes) == (pytest.approx(0.625), pytest.approx(0.625),
                                                          pytest.approx(1.25), pytest.approx(800))
    d = choose_schedule([c] * 2, memory_limit_bytes=1e9, batch_size=16, schedule_names=["1f1b"])
    assert [o.num_microbatches for o in sorted(d.options, key=lambda o: o.num_microbatches)] == [1, 2, 4, 8, 16]
    steps = {o.num_microbatches: o.step_s for o in d.options}
    assert d.num_microbatches == min(steps, key=steps.get) and 1 < d.num_microbatches < 16


def test_a_cost_curve_interpolates_the_sizes_measured():
    # Note [cost curve]: convex, as the wide head's cost is; the affine model overestimates the middle.
    c = StageCost(f=4.0, b=8.0, w=0.0, rows=16, in_bytes=16,
                  curve=((1, 0.2, 0.4, 0.0, 0.4), (4, 1.0, 2.0, 0.0, 2.0), (16, 4.0, 8.0, 0.0, 8.0)))
    assert (c.at(4).f, c.at(4).full, c.at(2).f) == (1.0, 2.0, pytest.approx(0.2 + 0.8 / 3))
    assert c.at(32).f == pytest.approx(4.0 + 3.0 / 12 * 16)  # the end segment, extended
    assert c.at(0.5).f == pytest.approx(0.2 - 0.8 / 6)
    assert c.at(4).recomputed().full == pytest.approx(3.0) and c.scaled(f=2.0).at(4).f == pytest.approx(2.0)
    assert c.at(8).in_bytes == pytest.approx(8)  # bytes stay proportional to rows
    with pytest.raises(ValueError, match=r"StageCost.curve must be .* in increasing rows"):
        StageCost(f=1.0, b=1.0, w=0.0, curve=((4, 1, 1, 0, 1), (2, 1, 1, 0, 1)))
    # Three sizes measured give a curve through them; two give the affine model alone.
    m = [Measurement(f=t, b=2 * t, w=t, full=3 * t, act_bytes=0, out_bytes=0, param_bytes=0) for t in (2.0, 4.0, 9.0)]
    three = StageCost.through([(8, m[2]), (1, m[0]), (4, m[1])])
    assert three.rows == 8 and three.at(4).f == 4.0 and three.at(2).full == pytest.approx(3 * 8 / 3)
    two = StageCost.through([(1, m[0]), (8, m[2])])
    assert two.curve == () and two.at(4).f == pytest.approx(1.0 + 4 * 1.0)  # fixed 1, 1 per row


def test_choose_errors():
    with pytest.raises(ValueError, match=r"no schedule accepts 3 stages"):
        choose_schedule(COSTS[:3], memory_limit_bytes=1e9, schedule_names=["zbv"])
    with pytest.raises(ValueError, match=r"microbatch counts must be positive integers dividing the batch size"):
        choose_schedule(COSTS, memory_limit_bytes=1e9, batch_size=8, microbatches=[3])
    with pytest.raises(ValueError, match=r"StageCost.f must be finite"):
        StageCost(f=-1.0, b=0.0, w=0.0)


def test_measure_module_counts_time_and_bytes():
    module = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    x = torch.randn(16, 8)
    m = measure_module(module, x, repeats=2)
    assert min(m.f, m.b, m.w, m.full) > 0
    assert m.out_bytes == 16 * 4 * 4
    assert m.param_bytes == sum(p.numel() * 4 for p in module.parameters())
    # At least the input, the hidden activation and the output stay alive until the backward.
    assert m.act_bytes >= (16 * 8 + 16 * 32 + 16 * 4) * 4
    # A split backward's W starts from the gradients at both Linears' outputs (actors/split_backward.py).
    assert m.seed_bytes == (16 * 32 + 16 * 4) * 4
    assert all(p.grad is None for p in module.parameters())
    assert m.output.shape == (16, 4) and not m.output.requires_grad


def test_plan_pipeline_measures_and_decides_without_ray():
    stages, (x, y) = make_stages(3), make_data(1, 8)[0]
    d = plan_pipeline(stages, "1f1b", PipelineConfig.from_options(device="cpu"), (x, y), mse,
                      num_microbatches="auto", repeats=1, verbose=False)
    assert d.schedule == "1f1b" and sorted(o.num_microbatches for o in d.options) == [1, 2, 4, 8]
    assert len(d.stage_costs) == 3 and all(c.f > 0 and c.param_bytes > 0 for c in d.stage_costs)
    # Every candidate size was timed (8, 4, 2 and 1 rows): Note [cost curve].
    assert [[x for x, *_ in c.curve] for c in d.model_costs] == [[1, 2, 4, 8]] * 3
    d = plan_pipeline(stages, "auto", PipelineConfig.from_options(device="cpu", memory_limit_bytes=1 << 30),
                      (x, y), mse, num_microbatches=4, repeats=1, verbose=False)
    assert {o.num_microbatches for o in d.options} == {4} and len({o.schedule for o in d.options}) > 1
    # dp=2 with zero not given (planning.choose_zero): a limit only sharded optimizer state meets chooses zero=1.
    dp2 = PipelineConfig.from_options(dp=2, device="cpu", memory_limit_bytes=1 << 30)
    x2, y2 = torch.cat([x, x]), torch.cat([y, y])
    full = plan_pipeline(stages, "1f1b", dp2, (x2, y2), mse, num_microbatches=4, repeats=1, verbose=False)
    tight = PipelineConfig.from_options(dp=2, device="cpu", memory_limit_bytes=int(full.peak_bytes) - 1)
    d = plan_pipeline(stages, "1f1b", tight, (x2, y2), mse, num_microbatches=4, repeats=1, verbose=False)
    assert full.zero == 0 and d.zero == 1 and d.recompute == () and d.peak_bytes < full.peak_bytes
    # zero pinned (not chosen): never zero=1.  Recompute does not help stages this small either: a
    # recomputed microbatch keeps the RNG state to replay (5 KiB), more than their activations
    # (Note [recomputed phases] in mpmd/planning/phases.py), so nothing fits.
    with pytest.raises(ValueError, match=r"or pass zero=1 with dp > 1"):
        plan_pipeline(stages, "1f1b", PipelineConfig.from_options(dp=2, zero=0, device="cpu",
                                                                  memory_limit_bytes=int(full.peak_bytes) - 1),
                      (x2, y2), mse, num_microbatches=4, repeats=1, verbose=False)
    with pytest.raises(ValueError, match=r"does not split into num_microbatches=3"):
        plan_pipeline(stages, "auto", PipelineConfig.from_options(device="cpu"), (x, y), mse, num_microbatches=3)


def test_pipeline_auto_argument_errors():
    stages = make_stages(2)
    with pytest.raises(ValueError, match=r"pass sample=\(inputs, targets\)"):
        mpmd.Pipeline(stages, schedule="auto", loss_fn=mse, device="cpu")
    sched = schedules.get_schedule("1f1b", 2, 4)
    with pytest.raises(ValueError, match=r"fixes num_microbatches=4"):
        mpmd.Pipeline(stages, schedule=sched, num_microbatches="auto", sample=make_data(1, 8)[0], device="cpu")
    with pytest.raises(ValueError, match=r"num_microbatches must be a positive integer or 'auto'"):
        mpmd.Pipeline(stages, num_microbatches="many", device="cpu")
    with pytest.raises(ValueError, match=r"memory_limit_bytes must be > 0"):
        mpmd.Pipeline(stages, memory_limit_bytes=0, device="cpu")


def test_pipeline_chooses_and_trains_like_the_reference(ray_session, capsys):
    stages = make_stages(2)
    data = make_data(steps=2, batch=8)
    with mpmd.Pipeline(stages, schedule="auto", num_microbatches="auto", sample=data[0], loss_fn=mse,
                       optimizer=sgd, device="cpu", memory_limit_bytes=1 << 30, num_actors=2) as pipe:
        d = pipe.auto_decision
        assert pipe.schedule.name == d.schedule and pipe.schedule.num_microbatches == d.num_microbatches
        assert pipe.num_ranks == d.num_ranks == 2
        assert "schedule='auto'" in capsys.readouterr().out
        losses = [pipe.step(x, y) for x, y in data]
        got = list(pipe.state_dict().values())
    assert_trained_like_reference(losses, got, stages, data, d.num_microbatches, mse, sgd)


def test_pipeline_auto_turns_zero_on_where_only_it_fits(ray_session, capsys):
    # dp=2, zero not given, a limit no plan meets with every replica holding all the optimizer state.
    stages, data = make_stages(2), make_data(steps=2, batch=16)
    base = PipelineConfig.from_options(dp=2, device="cpu", memory_limit_bytes=1 << 30)  # zero not given: chosen
    free = plan_pipeline(stages, "1f1b", base, data[0], mse, num_microbatches="auto", repeats=1, verbose=False)
    limit = int(min(o.peak_bytes for o in free.options)) - 1
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches="auto", sample=data[0], loss_fn=mse, optimizer=sgd,
                       device="cpu", dp=2, memory_limit_bytes=limit, auto_calibrate=False) as pipe:
        d = pipe.auto_decision
        assert d.zero == 1 and d.recompute == () and pipe.config.layout.zero == 1
        assert "it fits only with the optimizer state split over the dp=2 replicas" in capsys.readouterr().out
        losses = [pipe.step(x, y) for x, y in data]
        got = list(pipe.state_dict().values())
    assert_trained_like_reference(losses, got, stages, data, 2 * d.num_microbatches, mse, sgd)


def test_auto_measures_in_a_task_placed_as_an_actor_and_under_the_runs_precision(ray_session, monkeypatch):
    """Note [measured where it runs] (mpmd/planning/away.py): away from the controller (on CUDA
    by default; asked for here on CPU) the stages are measured in a Ray task, never in this
    process, whose measuring is made to fail; the costs are the same kind of numbers.  Under
    bf16 the stages are measured as the actors run them: their outputs handed on in bf16."""
    import mpmd.planning.auto as auto

    stages, (x, y) = make_stages(3), make_data(1, 8)[0]
    config = PipelineConfig.from_options(device="cpu")
    here = plan_pipeline(stages, "1f1b", config, (x, y), mse, num_microbatches=4, repeats=1, verbose=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the controller measured the stages")

    monkeypatch.setattr(auto, "measure_here", refuse)
    away = plan_pipeline(stages, "1f1b", config, (x, y), mse, num_microbatches=4, repeats=1, verbose=False, away=True)
    assert len(away.stage_costs) == 3 and all(c.f > 0 and c.param_bytes > 0 for c in away.stage_costs)
    for got, want in zip(away.stage_costs, here.stage_costs):  # measured alike: the same bytes
        assert (got.act_bytes, got.out_bytes, got.param_bytes) == (want.act_bytes, want.out_bytes, want.param_bytes)
    bf16 = plan_pipeline(stages, "1f1b", PipelineConfig.from_options(device="cpu", precision="bf16"), (x, y), mse,
                         num_microbatches=4, repeats=1,
                         verbose=False, away=True)
    for half, whole in zip(bf16.stage_costs[:-1], away.stage_costs[:-1]):  # the last stage's loss stays float
        assert half.out_bytes == whole.out_bytes // 2
