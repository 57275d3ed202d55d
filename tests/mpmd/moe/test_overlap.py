"""DualPipeV with its forward-backward pairs overlapped on the actors (docs/overlap.md): the
same pipeline with ``overlap=True`` and ``overlap=False`` bit-identical on CPU, and equal to one
process at pp=2 x dp=2 x ep=2; when ``overlap="auto"`` uses it; bad input refused before any
actor starts."""

from __future__ import annotations

import pytest
import torch

import mpmd
import schedules
from mpmd.models.gpt import gpt_stages, lm_loss
from mpmd.moe import loss_scale
from mpmd.runtime import PipelineConfig, build_schedule
from schedules import Kind
from tests.models import Reference, sgd
from tests.mpmd.moe.test_expert_parallel import _actor_state, _config, _data, _whole_state

MICROBATCHES, ROWS, DP, EP = 4, 1, 2, 2  # dualpipev needs 2 x pp microbatches


def _overlapped(schedule) -> int:
    return sum(a.kind is Kind.OVERLAP for acts in schedule.ranks for a in acts)


def _turns(worker) -> int:
    last = worker.interpreter.overlapper.last
    return last.turns if last is not None else 0


def _train(stages, data, overlap) -> tuple:
    with mpmd.Pipeline(stages, schedule="dualpipev", num_microbatches=MICROBATCHES, loss_fn=lm_loss, optimizer=sgd,
                       dp=DP, ep=EP, device="cpu", overlap=overlap) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        got = pipe.engine.client.run_in_each(_actor_state, "reading the stages")
        turns = pipe.engine.client.run_in_each(_turns, "reading the overlaps")
        pairs = _overlapped(pipe.schedule)
    return losses, _whole_state(got, DP, EP), turns, pairs


def test_dualpipev_overlapped_is_bit_identical_to_unoverlapped_and_equal_to_one_process(ray_session):
    stages = gpt_stages(_config(), 4)
    data = _data(MICROBATCHES * DP * ROWS)
    losses, state, turns, pairs = _train(stages, data, True)
    plain_losses, plain_state, plain_turns, plain_pairs = _train(stages, data, False)
    assert pairs > 0 and plain_pairs == 0
    assert all(t > 0 for t in turns) and not any(plain_turns)  # the sides took turns at the exchanges
    assert losses == plain_losses
    assert state.keys() == plain_state.keys()
    for k, v in plain_state.items():
        assert torch.equal(state[k], v), k

    def forward(model, x, side):
        with loss_scale(1.0 / (MICROBATCHES * DP)):
            return model(x)

    ref = Reference(stages, MICROBATCHES * DP, lm_loss, sgd, forward=forward)
    ref_losses = [ref.step(x, y).loss for x, y in data]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for k, v in ref.model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{k}: {msg}")


def _built(schedule="dualpipev", **options):
    return build_schedule(schedule, 4, PipelineConfig.from_options(**options), MICROBATCHES)


def test_auto_overlaps_dualpipev_when_the_experts_are_split():
    assert _overlapped(_built(dp=2, ep=2)) > 0
    assert _overlapped(_built(dp=2, ep=1)) == 0  # no all-to-all to hide
    assert _overlapped(_built(dp=2, ep=2, overlap=False)) == 0
    assert _overlapped(_built(overlap=True)) > 0  # asked for: runs, with nothing to hide
    assert _overlapped(_built("zbv", dp=2, ep=2)) == 0  # no pairs in its order


def test_a_schedule_given_runs_as_written_or_unoverlapped():
    written = schedules.get_schedule("dualpipev", 2, MICROBATCHES, overlap=True)
    assert _overlapped(_built(written)) == _overlapped(written) > 0
    flat = _built(written, overlap=False)
    assert _overlapped(flat) == 0
    assert [list(schedules.flat(acts)) for acts in written.ranks] == [list(acts) for acts in flat.ranks]


def test_bad_overlap_requests_are_refused():
    with pytest.raises(ValueError, match=r"overlap must be 'auto', True or False, got 'yes'"):
        PipelineConfig.from_options(overlap="yes")
    with pytest.raises(ValueError, match=r"1f1b has no overlapped forward-backward pairs, so overlap=True"):
        mpmd.Pipeline(gpt_stages(_config(), 2), schedule="1f1b", dp=2, ep=2, overlap=True, loss_fn=lm_loss)
    plain = schedules.get_schedule("dualpipev", 2, MICROBATCHES)
    with pytest.raises(ValueError, match=r"overlap=True, but the schedule given has no OVERLAP action"):
        _built(plain, overlap=True)


class _FailsAtThird:
    """The loss function, raising at its third call: the last stage's third forward, which
    dualpipev at 2 ranks runs inside an OVERLAP (``3F2+0B0``)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits, targets):
        self.calls += 1
        if self.calls == 3:
            raise ValueError("the third loss fails")
        return lm_loss(logits, targets)


def test_an_error_inside_an_overlap_names_the_instruction(ray_session):
    with mpmd.Pipeline(gpt_stages(_config(), 4), schedule="dualpipev", num_microbatches=MICROBATCHES,
                       loss_fn=_FailsAtThird(), optimizer=sgd, device="cpu", overlap=True) as pipe:
        x, y = _data(MICROBATCHES * ROWS)[0]
        with pytest.raises(mpmd.StageFailedError, match=r"loss_fn failed on the output of stage 3") as info:
            pipe.step(x, y)
    assert info.value.in_loss and info.value.stage == 3 and info.value.instruction == "3F2"
    assert "the third loss fails" in info.value.actor_traceback
