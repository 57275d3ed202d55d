"""ZeRO-1 under the pipeline (``zero=1``): the replicas split the optimizer state, and training
still equals one process on the global batch (Note [ZeRO-1 sharding] in actors/zero.py)."""

from __future__ import annotations

import copy

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd
from actors.zero import assign_owners, merge_named, named_state, positional_state

from tests.models import adamw, assert_trained_like_reference, make_data, make_stages, sgd

MICROBATCHES = 4
STAGES = {"1f1b": 2, "interleaved-1f1b": 4, "zb-h1": 2, "zbv": 4, "dualpipev": 4}  # all on 2 ranks


def train(stages, data, **options):
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, device="cpu", zero=1,
                       **options) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        held = ray.get([a.memory_bytes.remote() for a in pipe.actors])
        return losses, list(pipe.state_dict().values()), held


@pytest.mark.parametrize("schedule, optimizer, dp, transport", [
    ("1f1b", sgd, 2, "auto"), ("1f1b", adamw, 2, "auto"), ("interleaved-1f1b", adamw, 2, "auto"),
    ("zb-h1", sgd, 2, "auto"), ("zbv", adamw, 2, "auto"), ("dualpipev", sgd, 2, "auto"), ("1f1b", sgd, 4, "auto"),
    ("1f1b", adamw, 2, "staged")])  # the shared-GPU path: the collectives through staged host copies
def test_zero1_equals_single_process_on_the_global_batch(ray_session, schedule, optimizer, dp, transport):
    stages, data = make_stages(STAGES[schedule], d=16), make_data(3, 2 * MICROBATCHES * dp)
    losses, params, held = train(stages, data, schedule=schedule, optimizer=optimizer, dp=dp, transport=transport)
    assert_trained_like_reference(losses, params, stages, data, MICROBATCHES * dp, F.mse_loss, optimizer)
    # Each replica of a rank holds the optimizer state of its own parameters only: together, once.
    num_ranks = len(held) // dp
    assert sum(m["optimizer"] for m in held) == dp_state_bytes(copy.deepcopy(stages), optimizer)
    for r in range(num_ranks):
        mine = [held[d * num_ranks + r]["optimizer"] for d in range(dp)]
        assert 0 < max(mine) < sum(mine)


def dp_state_bytes(stages, optimizer) -> int:
    """The bytes of one whole optimizer state for ``stages`` (after a step)."""
    model = torch.nn.Sequential(*stages)
    opt = optimizer(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
               if isinstance(t, torch.Tensor))


def test_owners_balance_whole_parameters_by_bytes():
    assert assign_owners([100, 60, 50, 10], 2) == [0, 1, 1, 0]  # loads 110 and 110
    assert assign_owners([8, 8, 8, 8], 4) == [0, 1, 2, 3]
    assert assign_owners([5], 3) == [0]  # a replica may own nothing


def test_named_optimizer_state_round_trips_through_shards():
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(3)]
    opt = torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}], lr=0.1)
    for p in params:
        p.grad = torch.randn(3)
    opt.step()
    order = [["a", "b"], ["c"]]
    named = named_state(opt.state_dict(), order)
    halves = [{"state": {k: v for k, v in named["state"].items() if k in keep},
               "param_groups": [dict(g, params=[n for n in g["params"] if n in keep]) for g in named["param_groups"]]}
              for keep in ({"a"}, {"b", "c"})]
    back = positional_state(merge_named(halves), order)
    assert back["param_groups"] == opt.state_dict()["param_groups"]
    for i, state in opt.state_dict()["state"].items():
        assert all(torch.equal(state[k], back["state"][i][k]) for k in state)


def test_lbfgs_is_refused_with_zero1(ray_session):
    with pytest.raises(Exception, match="LBFGS updates all parameters as one flat vector.*use zero=0"):
        mpmd.Pipeline(make_stages(2), num_microbatches=2, loss_fn=F.mse_loss, dp=2, zero=1, device="cpu",
                      optimizer=lambda params: torch.optim.LBFGS(params))


def test_zero_must_be_0_or_1():
    with pytest.raises(ValueError, match="zero must be 0 .* or 1"):
        mpmd.Pipeline(make_stages(2), zero=2, device="cpu")


def test_the_profile_shows_the_sharded_state_and_the_all_gather_as_comm_wait(ray_session):
    stages, data = make_stages(2, d=16), make_data(1, 2 * MICROBATCHES * 2)
    with mpmd.Pipeline(stages, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=adamw, device="cpu",
                       dp=2, zero=1) as pipe:
        report = pipe.profile(*data[0], steps=2)
    assert sum(report.optimizer_bytes) == dp_state_bytes(copy.deepcopy(stages), adamw)
    assert report.param_bytes[0] == report.param_bytes[2] > 0  # every replica holds every parameter
    gathers = [s for s in report.slices if s.kind == "ALLGATHER"]
    assert {s.actor for s in gathers} == set(range(4))
    for a in range(4):  # the all-gather is comm wait, never the optimizer step's time
        gathered = sum(s.seconds for s in gathers if s.actor == a) / 2
        assert report.comm_wait_seconds[a] >= gathered > 0
    assert "params/grads/optimizer MiB" in report.summary()
    assert report.calibrated_costs.zero == 1 and report.calibrated_costs.allgather(0) > 0
