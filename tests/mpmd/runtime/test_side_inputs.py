"""Side inputs: values a step hands to the stages and the loss that take them (an attention
mask, a loss mask), cut into microbatches with the inputs or given whole; training with
them equals single-process training with the same values per microbatch."""

from __future__ import annotations


import pytest
import torch
from torch import nn

import mpmd
import schedules
from mpmd.runtime.side import side_spec

from tests.models import reference_train, sgd

MICROBATCHES, D = 2, 6


class Masked(nn.Module):
    """A stage that multiplies its output by a per-example mask (think: attention mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, mask=None):
        h = torch.tanh(self.lin(x))
        return h * mask if mask is not None else h


class Shifted(nn.Module):
    """A stage that takes every side input (``**kwargs``) and uses one given whole."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, h, **side):
        return self.lin(h) + side["shift"]


class Plain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, 3)

    def forward(self, h):
        return self.lin(h)


def masked_mse(out, target, loss_mask):
    return ((out - target) ** 2 * loss_mask).sum() / loss_mask.sum()


def stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [Masked(), Shifted(), Plain()]


def batches(steps: int, batch: int):
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(steps):
        x, y = torch.randn(batch, D, generator=g), torch.randn(batch, 3, generator=g)
        side = {"mask": (torch.rand(batch, D, generator=g) > 0.3).float(), "shift": torch.randn(D, generator=g),
                "loss_mask": (torch.rand(batch, 3, generator=g) > 0.5).float() + 0.1}
        out.append((x, y, side))
    return out


def side_forward(model, x, side):
    """Each stage takes the side values it names: the per-example mask sliced per microbatch,
    the shift whole."""
    return model[2](model[1](model[0](x, mask=side["mask"]), shift=side["shift"]))


@pytest.mark.parametrize("schedule, dp", [("1f1b", 1), ("gpipe", 2)])
def test_side_inputs_reach_the_stages_and_the_loss_that_take_them(ray_session, schedule, dp):
    data = batches(3, 4 * dp)
    model, ref_losses = reference_train(stages(), data, MICROBATCHES * dp, masked_mse, sgd, forward=side_forward,
                                        whole_side=("shift",), loss_side=("loss_mask",))
    with mpmd.Pipeline(stages(), schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=masked_mse,
                       optimizer=sgd, dp=dp, device="cpu") as pipe:
        losses = pipe.fit(data, progress=False)  # batches of (inputs, targets, side)
        state = pipe.state_dict()
        x, y, side = data[0]
        predicted = pipe.predict(x, mask=side["mask"], shift=side["shift"])
        evaluated = pipe.evaluate(x, y, **side)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    with torch.no_grad():
        expected = model[2](model[1](model[0](x, mask=side["mask"]), shift=side["shift"]))
        torch.testing.assert_close(predicted, expected, rtol=1e-5, atol=1e-6)
        parts = MICROBATCHES * dp
        want = sum(masked_mse(o, t, m).item() for o, t, m in
                   zip(expected.chunk(parts), y.chunk(parts), side["loss_mask"].chunk(parts), strict=True)) / parts
    assert evaluated == pytest.approx(want, rel=1e-5)


def test_side_inputs_travel_only_to_the_actors_that_take_them():
    spec = side_spec(stages(), masked_mse)
    assert spec.stages == (("mask",), None, ()) and spec.loss == ("loss_mask",)
    schedule = schedules.get_schedule("1f1b", 3, 2)
    side = {"mask": torch.ones(4, D), "shift": torch.zeros(D), "loss_mask": torch.ones(4, 3)}
    per_actor = spec.per_actor(side, batch=4, schedule=schedule, dp=2, num_microbatches=2)
    names = [(sorted(mine[0]), sorted(mine[1])) if mine else None for mine in per_actor]
    # Stage 1 takes **kwargs: every name; the loss on the last stage takes loss_mask.
    assert names[:3] == [(["mask"], []), (["loss_mask", "mask"], ["shift"]), (["loss_mask"], [])]
    assert names[3:] == names[:3]  # the second replica's actors, with its own microbatches
    assert per_actor[0][0]["mask"].count == 2 and per_actor[3][0]["mask"].count == 2
    # A name nothing takes is refused (a typo would otherwise be dropped silently).
    strict = side_spec([Masked(), Plain()], masked_mse)
    with pytest.raises(ValueError, match=r"side input 'maks' is taken by no stage and not by loss_fn \(keyword "
                                         r"arguments their signatures accept: stage 0: mask; stage 1: none; "
                                         r"loss_fn: loss_mask\)"):
        strict.check(["mask", "maks"])
