"""The Ray runtime equals plain single-process gradient accumulation.

Every pipeline here runs on the session Ray (CPU, gloo) with 2-4 actors and a tiny
model, trained with SGD with momentum (``tests.models.sgd``): an update proportional to
the gradient, so a gradient off by any factor fails the comparison (AdamW would hide
it; ``test_a_gradient_off_by_a_factor_fails_the_comparison`` checks).  Pipeline start-up
costs seconds, so the tests of the API around a step
(predict, evaluate, state dicts, batch-size changes, fit) share one module-scoped
pipeline that is stepped in lockstep with a single-process reference model: every
test leaves both equal, in whatever order the tests run.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mpmd
import schedules

from tests.models import (Embed, Head, JoinPair, Reference, SplitPair, make_data, make_stages, reference_train, sgd,
                          with_gradient_scale)

STEPS = 3
BATCH = 8
MICROBATCHES = 4
RTOL, ATOL = 1e-5, 1e-7

# schedule -> num_actors for make_stages(4)
ACTORS = {"gpipe": 4, "1f1b": 4, "interleaved-1f1b": 2}
# "step-ray": step fusion with a Ray task per actor per step instead of the step channel.
FUSIONS = ("step", "step-ray", "consecutive", "none")


def assert_state_equal(state: dict, reference: dict) -> None:
    assert list(state) == list(reference), "state_dict keys differ from nn.Sequential(*stages)"
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


def assert_trained(state: dict, initial: dict) -> None:
    """The comparison is not trivially between untouched initial weights."""
    assert any(not torch.equal(initial[k], state[k]) for k in initial)


# -- every schedule x every fusion mode -------------------------------------------------------------


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("schedule", list(ACTORS))
def test_training_equals_reference(ray_session, schedule, fusion):
    train_and_compare(make_stages(4), schedule, ACTORS[schedule], fusion, MICROBATCHES)


@pytest.mark.parametrize("schedule, num_stages, actors, microbatches", [
    ("interleaved-1f1b", 6, 3, 6),  # p = 3, v = 2
    ("interleaved-1f1b", 6, 2, 4),  # p = 2, v = 3
])
def test_interleaving_beyond_two_ranks_and_two_stages_per_rank(ray_session, schedule, num_stages, actors,
                                                                microbatches):
    train_and_compare(make_stages(num_stages), schedule, actors, "step", microbatches)


def test_a_gradient_off_by_a_factor_fails_the_comparison(ray_session):
    """The comparison above can fail: gradients doubled inside the actors (a lost
    ``1/num_microbatches``, a sum for a mean) must not pass it."""
    with pytest.raises(AssertionError):
        train_and_compare(make_stages(4), "1f1b", 4, "step", MICROBATCHES, optimizer=with_gradient_scale(sgd, 2.0))


def train_and_compare(stages: list[nn.Module], schedule: str, actors: int, fusion: str, microbatches: int,
                      optimizer=sgd) -> None:
    """Train ``STEPS`` steps, predict and evaluate on the pipeline and in one process; assert equal."""
    batch = 2 * microbatches
    data = make_data(STEPS, batch)
    model, ref_losses = reference_train(stages, data, microbatches, F.mse_loss, sgd)
    x, y = make_data(1, batch, seed=9)[0]
    with torch.no_grad():
        ref_out = model(x)
        ref_eval = sum(F.mse_loss(model(a), b).item()
                       for a, b in zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)) / microbatches

    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=microbatches, loss_fn=F.mse_loss,
                       optimizer=optimizer, num_actors=actors, device="cpu",
                       fusion=fusion.removesuffix("-ray"), step_channel=fusion != "step-ray") as pipe:
        assert len(pipe.actors) == actors
        losses, rpcs = [], []
        for inputs, targets in data:
            losses.append(pipe.step(inputs, targets))
            rpcs.append(pipe.last_step_rpcs)
        state = pipe.state_dict()
        # The forward-only program, in the same fusion mode.
        out = pipe.predict(x)
        evaluated = pipe.evaluate(x, y)
        lowered = schedules.lower(pipe.schedule)

    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    assert_state_equal(state, model.state_dict())
    assert_trained(state, nn.Sequential(*stages).state_dict())
    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(evaluated, ref_eval, rtol=RTOL, atol=ATOL)

    # fusion="step": one RPC per actor per step; "none": one per instruction; "consecutive" between.
    instructions = sum(len(acts) for acts in lowered.ranks)
    expected = {"step": actors, "step-ray": actors, "none": instructions}.get(fusion)
    for n in rpcs:
        if expected is not None:
            assert n == expected, f"fusion={fusion!r}: {n} RPCs per step, expected {expected}"
        else:
            assert actors < n < instructions, f"fusion='consecutive': {n} RPCs per step"


# -- one pipeline in lockstep with a reference ------------------------------------------------------


def multi_tensor_stages() -> list[nn.Module]:
    """SplitPair hands JoinPair a tuple (tensor, {"gate": float, "mask": int64})."""
    torch.manual_seed(3)
    return [Embed(6, 8), SplitPair(8), JoinPair(8), Head(8, 3)]


class Twin:
    """A pipeline and the single-process reference (``models.Reference``), stepped together
    and compared after every step."""

    def __init__(self, pipe: mpmd.Pipeline, stages: list[nn.Module]) -> None:
        self.pipe = pipe
        self.reference = Reference(stages, MICROBATCHES, F.mse_loss, sgd)
        self.model = self.reference.model

    def reference_step(self, inputs, targets) -> float:
        return self.reference.step(inputs, targets).loss

    def step(self, inputs, targets) -> float:
        loss = self.pipe.step(inputs, targets)
        ref = self.reference_step(inputs, targets)
        torch.testing.assert_close(loss, ref, rtol=RTOL, atol=ATOL)
        self.check_state()
        return loss

    def check_state(self) -> None:
        assert_state_equal(self.pipe.state_dict(), self.model.state_dict())


@pytest.fixture(scope="module")
def twin(ray_session):
    stages = multi_tensor_stages()
    # interleaved-1f1b on 2 actors: stage s on actor s % 2, so the tuple/dict value of
    # SplitPair (stage 1, actor 1) crosses to JoinPair (stage 2, actor 0) over gloo.
    pipe = mpmd.Pipeline(stages, schedule="interleaved-1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                         optimizer=sgd, device="cpu")
    try:
        assert len(pipe.actors) == 2
        yield Twin(pipe, stages)
    finally:
        pipe.shutdown()


def test_multi_tensor_values_between_stages(twin):
    before = twin.pipe.state_dict()
    for x, y in make_data(STEPS, BATCH, seed=11):
        twin.step(x, y)
    assert_trained(twin.pipe.state_dict(), before)


def test_predict_equals_reference_forward(twin):
    x, _ = make_data(1, BATCH, seed=12)[0]
    out = twin.pipe.predict(x)
    with torch.no_grad():
        expected = twin.model(x)
    assert isinstance(out, torch.Tensor) and out.shape == expected.shape
    torch.testing.assert_close(out, expected, rtol=RTOL, atol=ATOL)


def test_evaluate_equals_reference_loss_and_changes_nothing(twin):
    x, y = make_data(1, BATCH, seed=13)[0]
    before = twin.pipe.state_dict()
    loss = twin.pipe.evaluate(x, y)
    with torch.no_grad():
        expected = sum(F.mse_loss(twin.model(a), b).item()
                       for a, b in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES), strict=True)) / MICROBATCHES
    torch.testing.assert_close(loss, expected, rtol=RTOL, atol=ATOL)
    after = twin.pipe.state_dict()
    for key in before:
        assert torch.equal(before[key], after[key]), f"evaluate changed {key}"
    # ...nor the optimizer: the next step still equals the reference's.
    twin.step(*make_data(1, BATCH, seed=14)[0])


def test_state_dict_has_the_keys_of_sequential(twin):
    state = twin.pipe.state_dict()
    assert list(state) == list(nn.Sequential(*multi_tensor_stages()).state_dict())
    assert all(isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in state.values())


def test_load_state_dict_round_trips(twin):
    state = twin.pipe.state_dict()
    changed = {k: v + 0.01 * (i + 1) for i, (k, v) in enumerate(state.items())}
    twin.pipe.load_state_dict(changed)
    loaded = twin.pipe.state_dict()
    assert list(loaded) == list(state)
    for key in changed:
        assert torch.equal(loaded[key], changed[key]), key
    # The loaded parameters train on like the reference's (optimizer state kept on both).
    twin.model.load_state_dict(changed)
    twin.step(*make_data(1, BATCH, seed=15)[0])
    # Loading what state_dict() returned is the identity.
    current = twin.pipe.state_dict()
    twin.pipe.load_state_dict(current)
    assert_state_equal(twin.pipe.state_dict(), current)


def test_load_state_dict_refuses_wrong_keys(twin):
    state = twin.pipe.state_dict()
    extra = dict(state, **{"4.proj.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"unexpected keys \['4\.proj\.weight'\]"):
        twin.pipe.load_state_dict(extra)
    missing = {k: v for k, v in state.items() if k != "0.proj.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['0\.proj\.bias'\]"):
        twin.pipe.load_state_dict(missing)
    renamed = {("layer." + k if k.startswith("3.") else k): v for k, v in state.items()}
    with pytest.raises(ValueError, match=r"missing keys \['3\.out\.bias', '3\.out\.weight'\].*unexpected keys"):
        twin.pipe.load_state_dict(renamed)
    # Refused before anything was loaded: the pipeline is unchanged and trains on.
    twin.check_state()
    twin.step(*make_data(1, BATCH, seed=16)[0])


def test_changing_the_batch_size_relearns_shapes(twin):
    for i, batch in enumerate((16, 8, 12, 16)):
        twin.step(*make_data(1, batch, seed=20 + i)[0])
    x = make_data(1, 12, seed=30)[0][0]
    with torch.no_grad():
        expected = twin.model(x)
    torch.testing.assert_close(twin.pipe.predict(x), expected, rtol=RTOL, atol=ATOL)


def test_batch_not_divisible_by_microbatches_is_refused(twin):
    x, y = make_data(1, 10, seed=40)[0]
    with pytest.raises(ValueError, match=r"batch size 10, which does not split into 4 equal microbatches"):
        twin.pipe.step(x, y)
    with pytest.raises(ValueError, match=r"batch size 10"):
        twin.pipe.predict(x)
    # Nothing ran: the pipeline is open and still equals the reference.
    twin.step(*make_data(1, BATCH, seed=41)[0])


def test_fit_returns_the_per_step_losses(twin):
    data = make_data(STEPS, BATCH, seed=50)
    history = twin.pipe.fit(data, progress=False)
    expected = [twin.reference_step(x, y) for x, y in data]
    assert len(history) == STEPS
    torch.testing.assert_close(torch.tensor(history), torch.tensor(expected), rtol=RTOL, atol=ATOL)
    twin.check_state()


def test_steps_issued_ahead_run_in_order_and_equal_the_reference(twin):
    """step_async: three steps in flight at once, then their results, oldest first."""
    data = make_data(3, BATCH, seed=52)
    pending = [twin.pipe.step_async(x, y) for x, y in data]
    assert [p.step for p in pending] == [pending[0].step + k for k in range(3)]
    losses = [p.result() for p in pending]
    expected = [twin.reference_step(x, y) for x, y in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL, atol=ATOL)
    assert pending[0].result() == losses[0]  # a result is kept
    twin.check_state()


def test_fit_epochs_and_progress_bar(twin, capsys):
    data = make_data(2, BATCH, seed=51)
    history = twin.pipe.fit(data, epochs=2, progress=True)
    expected = [twin.reference_step(x, y) for _ in range(2) for x, y in data]
    torch.testing.assert_close(torch.tensor(history), torch.tensor(expected), rtol=RTOL, atol=ATOL)
    twin.check_state()
    err = capsys.readouterr().err
    assert "4/4" in err and f"loss {history[-1]:.4f}" in err


def test_fit_refuses_empty_data(twin):
    with pytest.raises(ValueError, match="no batches"):
        twin.pipe.fit([], progress=False)
    with pytest.raises(ValueError, match="no batches"):
        twin.pipe.fit(iter(()), progress=False)
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        twin.pipe.fit(make_data(1, BATCH), epochs=0, progress=False)
    twin.check_state()


# -- bugs found: each tears its pipeline down, so each has its own small one -----------------------


def small_pipeline() -> tuple[mpmd.Pipeline, list[nn.Module]]:
    stages = make_stages(2)
    pipe = mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd,
                         device="cpu", comm_timeout_s=20.0)
    return pipe, stages


def test_evaluate_at_another_batch_size_then_step(ray_session):
    (x8, y8), (x16, y16), (x8b, y8b) = make_data(1, 8, seed=60) + make_data(1, 16, seed=61) + make_data(1, 8, seed=62)
    pipe, stages = small_pipeline()
    with pipe:
        losses = [pipe.step(x8, y8)]
        loss16 = pipe.evaluate(x16, y16)
        losses.append(pipe.step(x8b, y8b))
        state = pipe.state_dict()
    model, ref = reference_train(stages, [(x8, y8), (x8b, y8b)], 2, F.mse_loss, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    assert_state_equal(state, model.state_dict())
    # The evaluation saw the parameters after the first step: the reference's after one step.
    after_one, _ = reference_train(stages, [(x8, y8)], 2, F.mse_loss, sgd)
    with torch.no_grad():
        expected16 = sum(F.mse_loss(after_one(a), b).item()
                         for a, b in zip(x16.chunk(2), y16.chunk(2), strict=True)) / 2
    assert loss16 == pytest.approx(expected16, rel=RTOL)


def test_load_state_dict_refuses_wrong_shapes_and_stays_usable(ray_session):
    pipe, stages = small_pipeline()
    with pipe:
        state = pipe.state_dict()
        bad = dict(state, **{"1.out.weight": torch.zeros(5, 5)})
        with pytest.raises(ValueError, match=r"1\.out\.weight"):
            pipe.load_state_dict(bad)
        assert_state_equal(pipe.state_dict(), state)
        assert len(pipe.actors) == 2
