"""Stage modules beyond the plain case, against single-process training (SGD): a weight
tied inside one stage, and an output whose shape follows the input's values."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import Head, make_data, reference_train, sgd

RTOL, ATOL = 1e-5, 1e-7


def assert_state_equal(state: dict, reference: dict) -> None:
    assert list(state) == list(reference)
    for key, value in reference.items():
        torch.testing.assert_close(state[key], value, rtol=RTOL, atol=ATOL, msg=lambda m: f"{key}: {m}")


class TiedBack(nn.Module):
    """Maps back through another layer's weight (weights tied inside one stage)."""

    def __init__(self, layer: nn.Linear) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return x @ self.layer.weight


def test_a_weight_tied_within_one_stage_trains_as_one_parameter(ray_session):
    # The stage is shipped in one piece, so both uses stay one parameter whose gradient is
    # their sum; SGD shows a gradient counted once instead of twice.
    torch.manual_seed(3)
    embed = nn.Linear(6, 8)
    stages = [nn.Sequential(embed, nn.Tanh(), TiedBack(embed)), Head(6, 3)]
    data = make_data(3, 8)
    model, ref = reference_train(stages, data, 2, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd, device="cpu") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    assert_state_equal(state, model.state_dict())
    assert torch.equal(state["0.0.weight"], state["0.2.layer.weight"])


class DropsAColumn(nn.Module):
    """An output whose width depends on the input's values, not its shape."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 8)

    def forward(self, x):
        return self.lin(x)[:, : 8 - int(x[0, 0] > 0)]


class SumHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.out = nn.Linear(1, 3)

    def forward(self, h):
        return self.out(h.sum(dim=1, keepdim=True))


def test_outputs_whose_shape_follows_the_values_need_dynamic_shapes(ray_session):
    torch.manual_seed(0)
    stages, data = [DropsAColumn(), SumHead()], make_data(3, 8)
    widths = {8 - int(x[0, 0] > 0) for inputs, _ in data[1:] for x in inputs.chunk(4)}
    assert widths == {7, 8}, "the data must make the width change after the first step"
    model, ref = reference_train(stages, data, 4, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, num_microbatches=4, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                       dynamic_shapes=True) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=RTOL, atol=ATOL)
    assert_state_equal(state, model.state_dict())
    # Without it the sender finds its output unlike the shape it announced, and says what to do.
    with mpmd.Pipeline(stages, num_microbatches=4, loss_fn=F.mse_loss, optimizer=sgd, device="cpu") as pipe:
        with pytest.raises(mpmd.StageFailedError, match=r"stage 0's output changed from \(2, \d\) float32 to "
                                                        r"\(2, \d\) float32 .*dynamic_shapes=True"):
            for x, y in data:
                pipe.step(x, y)
