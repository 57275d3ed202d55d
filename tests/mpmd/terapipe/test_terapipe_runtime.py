"""TeraPipe at run time: token-sliced GPT stages, token-sliced schedules, and training on
actors compared against unsliced single-process training of the same GPT."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import mpmd
import schedules
from mpmd.models import GPTConfig, GPTStage, gpt_stages, lm_loss
from mpmd.terapipe import (SliceLoss, choose_slices, fit_slice_cost, fit_step_model, plan_token_slicing,
                           probe_slicings, resolve_token_slices, token_slice)
from schedules import Action, Kind, Schedule, ScheduleError
from schedules.slicing import plan_slices, slicing_time, uniform_slices
from schedules.token_sliced import check_token_sliced_order, token_sliced_schedule

from tests.models import reference_train, sgd

CFG = GPTConfig(vocab_size=16, seq_len=16, d_model=16, n_heads=2, n_layers=2)


def attention_cost(length, context):
    return length * context + length * (length + 1) / 2 + 3.0


def gpt_data(steps: int, batch: int, seq_len: int = CFG.seq_len, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, CFG.vocab_size, (batch, seq_len + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def run_sliced(stages, x, y, slices):
    """Single process, the runtime's way: forwards in slice order (stage outputs detached
    at the boundary), then backwards in reverse slice order.  Returns the summed loss."""
    units, pos, total = [], 0, 0.0
    for length in slices:
        value, held = token_slice(x[:, pos:pos + length], 0, pos), []
        for stage in stages[:-1]:
            out = stage(value)
            value = {**out, "x": out["x"].detach().requires_grad_()}
            held.append((out["x"], value["x"]))
        loss = SliceLoss(lm_loss)(stages[-1](value), {"y": y[:, pos:pos + length],
                                                      "w": torch.tensor(length / x.shape[1])})
        units.append((loss, held))
        total += loss.item()
        pos += length
    for loss, held in reversed(units):
        loss.backward()
        for out, leaf in reversed(held):
            out.backward(leaf.grad)
    return total


# -- the sliced stage, in one process ------------------------------------------------------------------


@pytest.mark.parametrize("slices", [(16,), (4, 4, 4, 4), (6, 3, 2, 2, 1, 1, 1), (1, 15)])
def test_sliced_forward_backward_equals_unsliced(slices):
    stages = gpt_stages(GPTConfig(vocab_size=16, seq_len=16, d_model=16, n_heads=2, n_layers=3), 3)
    ref = nn.Sequential(*copy.deepcopy(stages))
    x, y = gpt_data(1, batch=2)[0]
    expected = lm_loss(ref(x), y)
    expected.backward()
    got = run_sliced(stages, x, y, slices)
    assert got == pytest.approx(expected.item(), rel=1e-5)
    for (name, p), (_, q) in zip(nn.Sequential(*stages).named_parameters(), ref.named_parameters(),
                                   strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert all(s.sequences_held == 0 for s in stages), "a sequence's context is released after its slice-0 backward"


def test_gpt_stage_is_sequential_on_tensors():
    stages = gpt_stages(CFG, 2)
    assert all(isinstance(s, GPTStage) and isinstance(s, nn.Sequential) for s in stages)
    x = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len))
    torch.testing.assert_close(stages[1](stages[0](x)), nn.Sequential(*stages)(x))
    assert list(copy.deepcopy(stages[0]).state_dict()) == list(stages[0].state_dict())


def test_sliced_forward_without_grad_matches_unsliced():
    stages = gpt_stages(CFG, 2)
    x = torch.randint(0, CFG.vocab_size, (1, CFG.seq_len))
    with torch.no_grad():
        full = nn.Sequential(*stages)(x)
        outs = [stages[1](stages[0](token_slice(x[:, a:b], 3, a))) for a, b in ((0, 5), (5, 12), (12, 16))]
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=1e-5, atol=1e-6)


def test_backward_out_of_slice_order_is_refused():
    stage = gpt_stages(CFG, 1)[0]
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    first = stage(token_slice(x[:, :4], 0, 0))
    stage(token_slice(x[:, 4:], 0, 4))
    with pytest.raises(RuntimeError, match=r"backward of token slice 0 of sequence 0 ran before the backward of "
                                           r"its slice 1; .* reverse slice order"):
        first.sum().backward()


def test_forward_out_of_slice_order_is_refused():
    stage = gpt_stages(CFG, 1)[0]
    x = torch.randint(0, CFG.vocab_size, (1, 8))
    stage(token_slice(torch.zeros(1, 14, dtype=torch.long), 0, 0))
    with pytest.raises(RuntimeError, match=r"position 6 of sequence 0 arrived, but this stage holds 14 earlier tokens"):
        stage(token_slice(x[:, 6:], 0, 6))
    with pytest.raises(ValueError, match=r"tokens 14\.\.17 are past the model's seq_len \(16\)"):
        stage(token_slice(torch.zeros(1, 4, dtype=torch.long), 0, 14))


# -- token-sliced schedules --------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks, microbatches, slices", [(1, 1, 1), (2, 1, 4), (2, 3, 3), (4, 2, 5), (3, 4, 1)])
def test_token_sliced_schedules_are_valid_and_deadlock_free(order, ranks, microbatches, slices):
    s = token_sliced_schedule(ranks, microbatches, slices, order)
    assert s.num_microbatches == microbatches * slices and s.num_ranks == ranks
    schedules.simulate_blocking(schedules.lower(s))
    check_token_sliced_order(s, slices)


def test_token_sliced_1f1b_keeps_fewer_units_alive_than_gpipe():
    gpipe = schedules.simulate(token_sliced_schedule(2, 4, 2, "gpipe"))
    one_f_one_b = schedules.simulate(token_sliced_schedule(2, 4, 2, "1f1b"))
    assert max(one_f_one_b.peak_activations) < max(gpipe.peak_activations) == 8


def test_registered_terapipe_schedule():
    assert "terapipe" in schedules.schedule_names()
    assert schedules.get_schedule("terapipe", 2, 3).to_text() == "0F0 0F1 0F2 0B2 0B1 0B0\n1F0 1F1 1F2 1B2 1B1 1B0"


def test_schedule_breaking_slice_order_is_refused():
    plain = schedules.get_schedule("1f1b", 2, 4)  # backwards in increasing order
    with pytest.raises(ScheduleError, match=r"rank 0, position 2: 0B0 is slice 0 of microbatch 0, but stage 0 must "
                                            r"run its slice 1 first: .* reverse slice order"):
        check_token_sliced_order(plain, 2)
    with pytest.raises(ScheduleError, match=r"6 units, which is not a multiple of num_slices \(4\)"):
        check_token_sliced_order(schedules.get_schedule("gpipe", 1, 6), 4)
    split = Schedule([[Action(0, Kind.F, 0), Action(0, Kind.I, 0), Action(0, Kind.W, 0)]], 1, (0,))
    with pytest.raises(ScheduleError, match=r"need fused backwards \(B\)"):
        check_token_sliced_order(split, 1)
    with pytest.raises(ValueError, match=r"unknown token-sliced order 'zbv'; use one of gpipe, 1f1b"):
        token_sliced_schedule(2, 1, 2, "zbv")
    with pytest.raises(ValueError, match=r"num_slices must be a positive integer, got 0"):
        token_sliced_schedule(2, 1, 0)


# -- choosing slices ----------------------------------------------------------------------------------


def test_resolve_token_slices():
    stages = gpt_stages(CFG, 2)
    assert resolve_token_slices([3, 13], stages)[0] == (3, 13)
    assert resolve_token_slices(4, stages)[0] == uniform_slices(16, 4)
    slices, plan, cost = resolve_token_slices(attention_cost, stages)
    assert slices == plan_slices(16, 2, attention_cost).slices == (6, 3, 2, 2, 1, 1, 1) and cost is attention_cost
    assert resolve_token_slices(attention_cost, stages, seq_len=16, granularity=4)[0] == plan_slices(
        16, 2, attention_cost, 4).slices


def test_slice_overhead_is_added_to_every_slice():
    stages = gpt_stages(CFG, 2)
    slices, plan, cost = resolve_token_slices(attention_cost, stages, slice_overhead=50.0)
    assert cost(4, 8) == attention_cost(4, 8) + 50.0
    assert plan == plan_slices(16, 2, lambda l, c: attention_cost(l, c) + 50.0)
    assert len(slices) < len(plan_slices(16, 2, attention_cost).slices)
    with pytest.raises(ValueError, match=r"slice_overhead must be a finite number of seconds >= 0, got -1"):
        resolve_token_slices("auto", stages, slice_overhead=-1)


@pytest.mark.parametrize("value, match", [
    ([4, 0, 12], r"token_slices must be positive slice lengths, got \[4, 0, 12\]"),
    ([], r"token_slices must be positive slice lengths"),
    ("fast", r"token_slices must be 'auto', a number of slices, a list of slice lengths or a cost"),
    (20, r"at most 16 slices are possible"),
])
def test_bad_token_slices(value, match):
    with pytest.raises(ValueError, match=match):
        resolve_token_slices(value, gpt_stages(CFG, 2))


def test_slices_must_add_up_to_seq_len():
    with pytest.raises(ValueError, match=r"add up to 12 tokens, but seq_len=16; make them add up to 16"):
        resolve_token_slices([4, 8], gpt_stages(CFG, 2), seq_len=16)
    with pytest.raises(ValueError, match=r"cannot tell the sequence length from the stages; pass seq_len"):
        resolve_token_slices(2, [GPTStage(nn.Linear(2, 2))])


def test_auto_measures_fits_and_plans():
    stages = gpt_stages(CFG, 2)
    cost = fit_slice_cost(stages, 16, granularity=2, repeats=1)
    assert cost(2, 0) > 0 and cost(16, 0) > 0
    slices, plan, _ = resolve_token_slices("auto", stages, granularity=2)
    assert sum(slices) == 16 and all(s % 2 == 0 for s in slices) and plan.slices == slices
    assert all(s.sequences_held == 0 for s in stages)


# -- the per-slice overhead measured on the actors (Note [calibrated slices]) ---------------------------


def measured_steps(slicings, fixed, varying, per_step, num_stages=2):
    """Step times as the calibrated model says the runtime takes them, attention_cost in ms."""
    cost = lambda l, c: attention_cost(l, c) * 1e-3  # noqa: E731
    return [(s, slicing_time(s, num_stages, lambda l, c: cost(l, c) + (varying if len(set(s)) > 1 else fixed))
             + per_step) for s in slicings], cost


def test_step_model_is_fitted_from_measured_steps_and_predicts_them():
    slicings = probe_slicings((6, 3, 2, 2, 1, 1, 1), 2, 1)
    assert slicings == [(6, 3, 2, 2, 1, 1, 1), (8, 8), (4,) * 4, (2,) * 8]
    measured, cost = measured_steps(slicings, fixed=0.004, varying=0.009, per_step=0.02)
    model = fit_step_model(measured, 2, cost)
    assert (model.fixed, model.varying, model.per_step) == pytest.approx((0.004, 0.009, 0.02), rel=1e-6)
    for slices, seconds in measured:
        assert model(slices) == pytest.approx(seconds, rel=1e-9)
    assert "per-slice overhead 4.00 ms (slices of one length), 9.00 ms (varying lengths)" in str(model)
    # a plan of one length gets a varying probe too; noise making an overhead negative clamps it at 0
    assert probe_slicings((4, 4, 4, 4), 4, 2) == [(4, 4, 4, 4), (2,) * 8, (6, 4, 4, 2)]
    noisy = fit_step_model([((16,), 0.2), ((8, 8), 0.1), ((4,) * 4, 0.05)], 2, lambda l, c: 0.0)
    assert noisy.fixed == noisy.varying == 0.0 and noisy.per_step == pytest.approx(0.35 / 3)
    steep = fit_step_model([((16,), 0.01), ((8, 8), 0.03), ((4,) * 4, 0.05)], 2, lambda l, c: 0.0)
    assert steep.per_step == 0.0 and steep.fixed == pytest.approx(0.36 / 38)  # through 0: sum(h t) / sum(h h)


def test_the_measured_overhead_moves_the_plan_to_fewer_slices_and_to_one_length():
    free, cost = measured_steps([(16,), (8, 8), (2,) * 8], fixed=0.0, varying=0.0, per_step=0.0)
    dp = plan_slices(16, 2, cost).slices
    assert choose_slices(fit_step_model(free, 2, cost), 16, 1).slices == dp  # no overhead: TeraPipe's DP plan
    costly, _ = measured_steps([(16,), (8, 8), (2,) * 8, dp], fixed=0.02, varying=0.02, per_step=0.01)
    chosen = choose_slices(fit_step_model(costly, 2, cost), 16, 1)
    assert len(chosen.slices) < len(dp) and chosen.slices == plan_slices(16, 2, lambda l, c: cost(l, c) + 0.02).slices
    # varying lengths costing more per slice: a uniform slicing beats the DP plan
    headers, _ = measured_steps([(16,), (8, 8), (2,) * 8, dp], fixed=0.001, varying=0.05, per_step=0.01)
    model = fit_step_model(headers, 2, cost)
    chosen = choose_slices(model, 16, 1)
    assert len(set(chosen.slices)) == 1 and chosen.total_time == model(chosen.slices)
    assert all(model(uniform_slices(16, n)) >= chosen.total_time for n in (1, 2, 4, 8, 16))


def test_bad_step_measurements():
    with pytest.raises(ValueError, match=r"needs at least 2 measured slicings, got 1"):
        fit_step_model([((16,), 0.1)], 2, attention_cost)
    with pytest.raises(ValueError, match=r"needs slices and a positive time, got \(8, 8\), -1"):
        fit_step_model([((16,), 0.1), ((8, 8), -1)], 2, attention_cost)


def test_only_auto_without_a_given_overhead_is_measured_on_the_actors():
    stages = gpt_stages(CFG, 2)
    assert plan_token_slicing(stages, "terapipe", 1, token_slices="auto", slice_granularity=2).calibrate
    assert not plan_token_slicing(stages, "terapipe", 1, token_slices="auto", slice_overhead=0.0).calibrate
    assert not plan_token_slicing(stages, "terapipe", 1, token_slices=attention_cost).calibrate
    assert not plan_token_slicing(stages, "terapipe", 1, token_slices=4).calibrate


def test_pipeline_refuses_stages_without_token_slices():
    with pytest.raises(ValueError, match=r"stages\[0\] \(Linear\) cannot run token slices; .*gpt_stages"):
        mpmd.Pipeline([nn.Linear(2, 2)], schedule="terapipe", loss_fn=lm_loss)
    with pytest.raises(ValueError, match=r"takes schedule= one of terapipe, gpipe, terapipe-1f1b, 1f1b, got 'zbv'"):
        mpmd.Pipeline(gpt_stages(CFG, 2), schedule="zbv", token_slices=2)
    with pytest.raises(ValueError, match=r"one stage on each actor: num_actors=1 but 2 stages"):
        mpmd.Pipeline(gpt_stages(CFG, 2), schedule="terapipe", token_slices=2, num_actors=1)


# -- training on actors against the single-process unsliced reference ----------------------------------


def assert_same_parameters(state: dict, ref_state: dict) -> None:
    """Every parameter equal at rtol 1e-5.  Slicing changes the shapes of the attention
    matmuls and so the rounding of every gradient (~1e-9 here); SGD moves a parameter by
    ``lr`` times that, far below the tolerance, while a gradient off by a factor shows.
    (AdamW would divide the rounding noise of the attention key biases, whose exact
    gradient is zero, by its own magnitude and move them by up to ``lr`` per step.)"""
    assert list(state) == list(ref_state)
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("schedule, token_slices, microbatches, dp", [
    ("terapipe", 4, 2, 1),                                 # uniform slices, two sequences per step
    ("terapipe-1f1b", (6, 3, 2, 2, 1, 1, 1), 1, 1),        # DP-chosen slices: plan_slices(16, 2, attention_cost)
    ("terapipe", (8, 4, 4), 1, 2),                         # two replicas, one sequence each
])
def test_token_sliced_training_equals_unsliced(ray_session, schedule, token_slices, microbatches, dp):
    assert plan_slices(16, 2, attention_cost).slices == (6, 3, 2, 2, 1, 1, 1)
    stages = gpt_stages(CFG, 2)
    data = gpt_data(3, batch=2)
    ref_model, ref_losses = reference_train(stages, data, microbatches * dp, lm_loss, sgd)
    with mpmd.Pipeline(stages, schedule=schedule, token_slices=token_slices, num_microbatches=microbatches,
                       loss_fn=lm_loss, optimizer=sgd, device="cpu", dp=dp) as pipe:
        assert pipe.token_slicing is not None and pipe.num_ranks == 2 and len(pipe.actors) == 2 * dp
        losses = [pipe.step(x, y) for x, y in data]
        x, y = data[0]
        logits = pipe.predict(x)
        evaluated = pipe.evaluate(x, y)
        state = pipe.state_dict()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_parameters(state, ref_model.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(logits, ref_model(x), rtol=1e-5, atol=1e-5)
        assert evaluated == pytest.approx(lm_loss(ref_model(x), y).item(), rel=1e-5)


@pytest.mark.parametrize("schedule, dp", [("terapipe", 1), ("terapipe-1f1b", 2)])
def test_auto_token_slices_train_like_unsliced(ray_session, schedule, dp):
    stages = gpt_stages(CFG, 2)
    data = gpt_data(3, batch=dp)
    ref_model, ref_losses = reference_train(stages, data, dp, lm_loss, sgd)
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=1, loss_fn=lm_loss, optimizer=sgd,
                       device="cpu", slice_granularity=2, dp=dp) as pipe:
        slicing = pipe.token_slicing  # measured on the actors, planned again, the actors set up again
        assert sum(slicing.slices) == 16 and slicing.plan.slices == slicing.slices and not slicing.calibrate
        model = slicing.step_model
        assert len(model.measured) >= 3 and slicing.plan.total_time == model(slicing.slices)
        assert pipe.engine.step_count == 0 and pipe.schedule.num_microbatches == len(slicing.slices)
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
        with pytest.raises(ValueError, match=r"token-sliced inputs must be one tensor \(batch, 16\) .* got \(\d, 8\)"):
            pipe.step(data[0][0][:, :8], data[0][1][:, :8])
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert_same_parameters(state, ref_model.state_dict())


def test_a_token_sliced_checkpoint_restores_the_slicing_and_training_goes_on_unchanged(ray_session, tmp_path):
    """``Pipeline.load`` rebuilds the saved slices and sequence microbatches (not a fresh
    "auto" slicing, nor ``M x S`` microbatches of sequences) and the next steps are the
    ones the uninterrupted run takes, bit for bit."""
    data, slices = gpt_data(4, batch=2), (6, 3, 2, 2, 1, 1, 1)
    options = dict(loss_fn=lm_loss, optimizer=sgd, device="cpu")
    with mpmd.Pipeline(gpt_stages(CFG, 2), schedule="terapipe-1f1b", token_slices=slices, num_microbatches=2,
                       **options) as pipe:
        for x, y in data[:2]:
            pipe.step(x, y)
        path = pipe.save(tmp_path / "ck")
        later = [pipe.step(x, y) for x, y in data[2:]]
        expected = pipe.state_dict()
    with mpmd.Pipeline.load(path, stages=gpt_stages(CFG, 2, seed=7), **options) as loaded:
        slicing = loaded.token_slicing
        assert (slicing.slices, slicing.num_microbatches, slicing.order) == (slices, 2, "1f1b")
        assert loaded.schedule.name == "terapipe-1f1b" and loaded.schedule.num_microbatches == 2 * len(slices)
        assert [loaded.step(x, y) for x, y in data[2:]] == later
        state = loaded.state_dict()
    assert list(state) == list(expected)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key


def _float_targets_only(out, target):
    if not target.is_floating_point():
        raise ValueError("this loss takes float targets")
    return torch.nn.functional.mse_loss(out, target)


def test_auto_slices_say_what_their_timing_feeds_a_loss_that_refuses_it(ray_session):
    with pytest.raises(Exception, match=r"(?s)token_slices='auto' times slicings .* random token ids .*this loss takes "
                                        r"float targets.*pass slice_overhead="):
        mpmd.Pipeline(gpt_stages(CFG, 2), schedule="terapipe", num_microbatches=1, loss_fn=_float_targets_only,
                      device="cpu", slice_granularity=2)
