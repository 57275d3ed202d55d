"""ZeRO-1 with the rest of the recipe: tied parameters, active global-norm clipping with an LR
schedule, fp16 loss scaling with an overflow; each against its single-process reference."""

from __future__ import annotations

import math

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd

from tests.models import make_data, make_stages, reference_records, reference_train, sgd
from tests.mpmd.runtime.test_recipe import MICROBATCHES, OverflowsOnce, assert_close_to, warmup_cosine
from tests.mpmd.runtime.test_ties import assert_equal_to_reference, lm_loss, tied_copies, tied_lm, token_data

DP = 2


def test_a_tied_parameter_is_summed_after_the_dp_mean_then_sharded(ray_session):
    stages, data = tied_lm(3), token_data(3, 4 * DP)
    model, ref_losses = reference_train(stages, data, 2 * DP, lm_loss, sgd)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=lm_loss, optimizer=sgd, dp=DP, zero=1,
                       device="cpu") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state, copies = pipe.state_dict(), tied_copies(pipe, 0, 2)
    assert_equal_to_reference(losses, state, model, ref_losses)
    assert len(copies) == 2 * DP and all(torch.equal(c, copies[0]) for c in copies)


@pytest.mark.parametrize("clip, norm_type", [(0.05, 2.0), (0.01, math.inf)])
def test_clipping_counts_each_element_once_over_the_shards(ray_session, clip, norm_type):
    stages, data = make_stages(3), make_data(4, 4 * DP)
    model, ref = reference_records(stages, data, MICROBATCHES * DP, F.mse_loss, sgd, clip=clip, norm_type=norm_type,
                                   lr_scheduler=warmup_cosine)
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       dp=DP, zero=1, clip_grad_norm=clip, clip_norm_type=norm_type,
                       lr_scheduler=warmup_cosine) as pipe:
        results = [pipe.step_async(x, y).wait() for x, y in data]
        state = pipe.state_dict()
    assert all(n > clip for _, n, _ in ref), "the case meant to clip never did"
    for r, (loss, norm, lr) in zip(results, ref, strict=True):
        assert r.loss == pytest.approx(loss, rel=1e-5) and r.grad_norm == pytest.approx(norm, rel=1e-5)
        assert r.lr == pytest.approx(lr, rel=1e-12) and not r.skipped
    assert_close_to(state, model, rtol=1e-5, atol=1e-7)


def test_an_fp16_overflow_skips_the_step_on_every_shard_and_halves_the_scale(ray_session):
    stages = make_stages(2)
    stages[1] = OverflowsOnce(stages[1].out, at_call=2 * MICROBATCHES + 1)  # step 2's first microbatch
    data = make_data(4, 4 * DP)
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       precision="fp16", dp=DP, zero=1) as pipe:
        first = [pipe.step_async(x, y).wait() for x, y in data[:2]]
        before = pipe.state_dict()
        opt_before = ray.get([a.optimizer_state.remote() for a in pipe.actors])
        bad = pipe.step_async(*data[2]).wait()
        after_bad = pipe.state_dict()
        opt_after = ray.get([a.optimizer_state.remote() for a in pipe.actors])
        scales = [sd["loss_scale"]["scale"] for part in ray.get([a.checkpoint_state.remote() for a in pipe.actors])
                  for sd in part.values()]
        good = pipe.step_async(*data[3]).wait()
        last = pipe.state_dict()
    assert not any(r.skipped for r in first) and bad.skipped and not good.skipped
    assert all(torch.equal(before[k], after_bad[k]) for k in before), "an actor applied the overflowing step"
    assert opt_before == opt_after, "an optimizer shard stepped"
    assert scales == [2.0 ** 15] * (2 * DP), "every actor halves its loss scale"
    assert any(not torch.equal(after_bad[k], last[k]) for k in before)


def test_a_nonfinite_gradient_raises_and_leaves_every_shard_as_before(ray_session):
    stages = make_stages(2)
    stages[1] = OverflowsOnce(stages[1].out, at_call=2 * MICROBATCHES + 1)  # step 2's first microbatch
    data = make_data(3, 4 * DP)
    # fp32 looks at gradients only through the clipping norm (Note [agreed update]): a loose clip
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       dp=DP, zero=1, clip_grad_norm=1e3) as pipe:
        for x, y in data[:2]:
            pipe.step(x, y)
        before, opt_before = pipe.state_dict(), ray.get([a.optimizer_state.remote() for a in pipe.actors])
        with pytest.raises(FloatingPointError):
            pipe.step(*data[2])
        after, opt_after = pipe.state_dict(), ray.get([a.optimizer_state.remote() for a in pipe.actors])
    assert all(torch.equal(before[k], after[k]) for k in before) and opt_before == opt_after


def test_bf16_with_recompute_and_the_split_backward(ray_session):
    stages, data = make_stages(4), make_data(3, 4 * DP)
    model, ref = reference_records(stages, data, MICROBATCHES * DP, F.mse_loss, sgd, precision="bf16")
    with mpmd.Pipeline(stages, schedule="zbv", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu", dp=DP, zero=1, precision="bf16", recompute=True) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([r[0] for r in ref]), rtol=1e-3, atol=1e-5)
    assert_close_to(state, model, rtol=1e-3, atol=1e-4)
