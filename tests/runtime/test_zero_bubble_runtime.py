"""The zero-bubble schedules (split backward: ``I`` input gradient, ``W`` weight
gradient) train on actors to exactly what single-process gradient accumulation gives.

All on 2 actors: zb-h1 / zb-h2 with one stage each, zbv / dualpipev V-shaped with
stages r and 3-r on actor r (so stages 1 and 2 hand values over in memory).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import Embed, Head, JoinPair, SplitPair, adamw, make_data, make_stages, reference_train

STEPS = 3
BATCH = 8
MICROBATCHES = 4  # zb-h2 needs >= 2p-1 = 3, dualpipev >= 2p = 4 on 2 actors
RTOL, ATOL = 1e-5, 1e-7

NUM_STAGES = {"zb-h1": 2, "zb-h2": 2, "zbv": 4, "dualpipev": 4}
FUSIONS = ("step", "consecutive", "none")


PROBE = make_data(1, BATCH, seed=9)[0][0]  # predicted after training


def train(stages: list[nn.Module], schedule: str, fusion: str):
    """Losses, final state_dict and ``predict(PROBE)`` of a 2-actor pipeline; and the pipeline (shut down)."""
    data = make_data(STEPS, BATCH)
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=adamw, num_actors=2, device="cpu", fusion=fusion) as pipe:
        assert len(pipe.actors) == 2
        losses = [pipe.step(x, y) for x, y in data]
        if fusion == "step":
            assert pipe.last_step_rpcs == 2
        return losses, pipe.state_dict(), pipe.predict(PROBE), pipe


def assert_equals_reference(stages, losses, state, predicted) -> None:
    model, ref_losses = reference_train(stages, make_data(STEPS, BATCH), MICROBATCHES, F.mse_loss)
    with torch.no_grad():
        torch.testing.assert_close(predicted, model(PROBE), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
    ref = model.state_dict()
    assert list(state) == list(ref)
    for key, value in ref.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")
    initial = nn.Sequential(*stages).state_dict()
    assert any(not torch.equal(initial[k], state[k]) for k in initial), "training did not move the parameters"


@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("schedule", list(NUM_STAGES))
def test_zero_bubble_training_equals_reference(ray_session, schedule, fusion):
    stages = make_stages(NUM_STAGES[schedule])
    losses, state, predicted, pipe = train(stages, schedule, fusion)
    kinds = {a.kind.name for acts in pipe.schedule.ranks for a in acts}
    assert {"I", "W"} <= kinds, f"{schedule} has no split backward: {sorted(kinds)}"
    if NUM_STAGES[schedule] == 4:
        assert pipe.schedule.stage_to_rank == (0, 1, 1, 0)
    assert_equals_reference(stages, losses, state, predicted)


def test_zbv_split_backward_of_multi_tensor_values(ray_session):
    """SplitPair (stage 1) and JoinPair (stage 2) share actor 1 under zbv: the
    tuple/dict value with an int64 mask is handed over in memory, and its input
    gradient computed by ``I`` separately from ``W``."""
    torch.manual_seed(3)
    stages = [Embed(6, 8), SplitPair(8), JoinPair(8), Head(8, 3)]
    losses, state, predicted, _ = train(stages, "zbv", "step")
    assert_equals_reference(stages, losses, state, predicted)
