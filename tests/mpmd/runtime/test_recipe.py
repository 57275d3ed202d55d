"""The training recipe against single-process references: global gradient-norm clipping,
LR schedules, mixed precision (bf16, fp16 with dynamic loss scaling), activation
recompute; and a resumed run with all of it, bit for bit."""

from __future__ import annotations

import copy
import math

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import make_data, make_stages, reference_records, sgd

MICROBATCHES = 2


def warmup_cosine(opt):
    """Linear warm-up over 2 steps, then cosine decay over 4."""
    return torch.optim.lr_scheduler.SequentialLR(opt, [
        torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=2),
        torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)], milestones=[2])


def train(stages, data, **options):
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       **options) as pipe:
        results = [pipe.step_async(x, y).wait() for x, y in data]
        return results, pipe.state_dict()


def assert_close_to(state, model, rtol: float, atol: float) -> None:
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("schedule, num_stages, dp, clip, norm_type", [
    ("1f1b", 3, 1, 0.05, 2.0),            # clipping active every step
    ("zb-h1", 2, 1, 100.0, 2.0),          # the split backward; clipping never active
    ("1f1b", 2, 2, 0.05, 2.0),            # two replicas: the norm of the averaged gradient
    ("interleaved-1f1b", 4, 1, 0.01, math.inf),  # the infinity norm, two stages per actor
])
def test_clipping_and_an_lr_schedule_equal_single_process(ray_session, schedule, num_stages, dp, clip, norm_type):
    stages, data = make_stages(num_stages), make_data(4, 4 * dp)
    model, ref = reference_records(stages, data, MICROBATCHES * dp, F.mse_loss, sgd, clip=clip, norm_type=norm_type,
                                   lr_scheduler=warmup_cosine)
    results, state = train(stages, data, schedule=schedule, dp=dp, clip_grad_norm=clip, clip_norm_type=norm_type,
                           lr_scheduler=warmup_cosine)
    for r, (loss, norm, lr) in zip(results, ref, strict=True):
        assert r.loss == pytest.approx(loss, rel=1e-5) and r.grad_norm == pytest.approx(norm, rel=1e-5)
        assert r.lr == pytest.approx(lr, rel=1e-12) and not r.skipped
    if clip < 1:
        assert all(n > clip for _, n, _ in ref), "the case meant to clip never did"
    assert_close_to(state, model, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("precision, schedule", [("bf16", "1f1b"), ("bf16", "zbv"), ("fp16", "1f1b")])
def test_mixed_precision_equals_the_same_autocast_in_one_process(ray_session, precision, schedule):
    stages, data = make_stages(4 if schedule == "zbv" else 2), make_data(3, 4)
    model, ref = reference_records(stages, data, MICROBATCHES, F.mse_loss, sgd, precision=precision)
    results, state = train(stages, data, schedule=schedule, precision=precision)
    torch.testing.assert_close(torch.tensor([r.loss for r in results]), torch.tensor([r[0] for r in ref]),
                               rtol=1e-3, atol=1e-5)
    assert_close_to(state, model, rtol=1e-3, atol=1e-4)  # bf16 rounds at 2**-8: a few ulps over 3 SGD steps
    assert all(v.dtype == torch.float32 for v in state.values()), "parameters stay in float32"


@pytest.mark.parametrize("schedule, recompute", [("1f1b", True), ("zb-h1", [0]), ("zbv", [1, 2])])
def test_recompute_is_exact(ray_session, schedule, recompute):
    stages, data = make_stages(4 if schedule == "zbv" else 2), make_data(3, 4)
    model, ref = reference_records(stages, data, MICROBATCHES, F.mse_loss, sgd)
    results, state = train(stages, data, schedule=schedule, recompute=recompute)
    torch.testing.assert_close(torch.tensor([r.loss for r in results]), torch.tensor([r[0] for r in ref]),
                               rtol=1e-5, atol=1e-7)
    assert_close_to(state, model, rtol=1e-5, atol=1e-7)


class Counted(nn.Module):
    """Three linears and a dropout; its forward calls counted in a buffer (read from the state)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(d_in, 8), nn.Tanh(), nn.Dropout(0.3), nn.Linear(8, 8), nn.Tanh(),
                                    nn.Linear(8, d_out))
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x):
        self.calls += 1
        return self.layers(x)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_recompute_under_a_split_backward_runs_each_forward_twice_and_is_bit_exact(ray_session, schedule):
    """Note [recompute at I]: once more at I, not once per weight node at W (a three-linear stage
    ran its forward five times per microbatch); dropout's masks replay bit for bit."""
    torch.manual_seed(0)
    n = 4 if schedule == "zbv" else 2
    stages = [Counted(6 if i == 0 else 8, 3 if i == n - 1 else 8) for i in range(n)]
    data = make_data(2, 4)
    plain, plain_state = train(copy.deepcopy(stages), data, schedule=schedule)
    again, state = train(copy.deepcopy(stages), data, schedule=schedule, recompute=True)
    assert [r.loss for r in again] == [r.loss for r in plain]
    for key, value in plain_state.items():
        if not key.endswith("calls"):
            assert torch.equal(state[key], value), key
    forwards = len(data) * MICROBATCHES
    for s in range(n):
        assert plain_state[f"{s}.calls"].item() == forwards
        assert state[f"{s}.calls"].item() == 2 * forwards, (s, state[f"{s}.calls"].item())


class OverflowsOnce(nn.Module):
    """A stage whose weight gets an infinite gradient on one forward (an fp16 overflow on one actor)."""

    def __init__(self, inner: nn.Linear, at_call: int) -> None:
        super().__init__()
        self.inner, self.at_call, self.calls = inner, at_call, 0

    def forward(self, x):
        self.calls += 1
        weight = self.inner.weight
        if self.calls == self.at_call:
            weight = weight.view_as(weight)
            weight.register_hook(lambda g: torch.full_like(g, float("inf")))
        return F.linear(x, weight, self.inner.bias)


def test_an_fp16_overflow_on_one_actor_skips_the_step_everywhere_and_halves_the_scale(ray_session):
    stages = make_stages(2)
    stages[1] = OverflowsOnce(stages[1].out, at_call=2 * MICROBATCHES + 1)  # step 2's first microbatch
    data = make_data(4, 4)
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       precision="fp16") as pipe:
        first = [pipe.step_async(x, y).wait() for x, y in data[:2]]
        before = pipe.state_dict()
        bad = pipe.step_async(*data[2]).wait()
        after_bad = pipe.state_dict()
        scales = [sd["loss_scale"]["scale"] for part in ray.get([a.checkpoint_state.remote() for a in pipe.actors])
                  for sd in part.values()]
        good = pipe.step_async(*data[3]).wait()
        last = pipe.state_dict()
    assert not any(r.skipped for r in first) and bad.skipped and not good.skipped
    assert math.isfinite(bad.loss) and pipe.skipped_steps == [2]  # a finite loss: the loss scale's business
    assert all(torch.equal(before[k], after_bad[k]) for k in before), "an actor applied the overflowing step"
    assert scales == [2.0 ** 15] * 2, "every actor halves its loss scale"
    assert any(not torch.equal(after_bad[k], last[k]) for k in before)


def test_a_resumed_run_with_a_schedule_and_clipping_is_bit_identical(ray_session, tmp_path):
    stages, data = make_stages(2), make_data(6, 4)
    options = dict(schedule="1f1b", clip_grad_norm=0.05, lr_scheduler=warmup_cosine)
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       **options) as pipe:
        pipe.fit(data[:3], progress=False)
        path = pipe.save(tmp_path / "ck")
        later = [pipe.step_async(x, y).wait() for x, y in data[3:]]
        expected = pipe.state_dict()
    with mpmd.Pipeline.load(path, stages=make_stages(2, seed=9), loss_fn=F.mse_loss, optimizer=sgd,
                            lr_scheduler=warmup_cosine) as resumed:
        again = [resumed.step_async(x, y).wait() for x, y in data[3:]]
        state = resumed.state_dict()
    assert [(r.loss, r.grad_norm, r.lr) for r in again] == [(r.loss, r.grad_norm, r.lr) for r in later]
    assert all(torch.equal(state[k], v) for k, v in expected.items())


def test_a_tied_parameter_enters_the_gradient_norm_once(ray_session):
    from tests.mpmd.runtime.test_ties import lm_loss, tied_lm, token_data

    stages, data = tied_lm(3), token_data(3, 4)
    model, records = reference_records(stages, data, MICROBATCHES, lm_loss, sgd, clip=0.1)
    norms = [r.grad_norm for r in records]  # clip_grad_norm_ counts the shared weight once
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=lm_loss, optimizer=sgd, device="cpu",
                       clip_grad_norm=0.1) as pipe:
        got = [pipe.step_async(x, y).wait().grad_norm for x, y in data]
        state = pipe.state_dict()
    assert got == pytest.approx(norms, rel=1e-5)
    assert_close_to(state, model, rtol=1e-5, atol=1e-7)
