"""mpmd.split: markers, balances, the min-max partition, errors, and training equivalence."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch import nn

import mpmd
from mpmd.planning import partition

from tests.models import Block, Embed, Head, make_data, reference_train, sgd


mse = torch.nn.functional.mse_loss


def _children(stages):
    return [list(s) for s in stages]


def test_markers_cut_exactly_where_placed():
    a, b, c, d, e = (nn.Linear(4, 4) for _ in range(5))
    model = nn.Sequential(a, b, mpmd.PipelineYield(), c, mpmd.PipelineYield(), d, e)
    x = torch.randn(3, 4)
    stages = mpmd.split(model, verbose=False)
    assert _children(stages) == [[a, b], [c], [d, e]]
    assert all(isinstance(s, nn.Sequential) for s in stages)
    torch.testing.assert_close(nn.Sequential(*stages)(x), model(x), rtol=0, atol=0)
    assert mpmd.split(model, num_stages=3, verbose=False).layer_counts == [2, 1, 2]


def test_marker_is_identity():
    y = mpmd.PipelineYield()
    x = (torch.randn(2), {"k": torch.ones(1)})
    assert y(x) is x


def test_balance_params_min_max():
    sizes = [(8, 8), (8, 64), (64, 8), (8, 8), (8, 8), (8, 8)]
    layers = [nn.Linear(i, o) for i, o in sizes]
    params = [sum(p.numel() for p in m.parameters()) for m in layers]  # 72, 576, 520, 72, 72, 72
    stages = mpmd.split(nn.Sequential(*layers), num_stages=3, verbose=False)
    assert stages.layer_counts == [2, 1, 3]
    assert max(stages.param_counts) == _brute_force(params, 3, [0.0] * 5)
    assert _children(stages) == [layers[:2], layers[2:3], layers[3:]]


def test_explicit_layer_counts():
    layers = [nn.Linear(4, 4) for _ in range(6)]
    stages = mpmd.split(nn.Sequential(*layers), balance=[1, 3, 2], verbose=False)
    assert _children(stages) == [layers[:1], layers[1:4], layers[4:]]
    assert mpmd.split(layers, num_stages=2, balance=[5, 1], verbose=False).layer_counts == [5, 1]


def _brute_force(costs, k, boundary):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), k - 1):
        edges = (0, *cuts, n)
        worst = max(sum(costs[i:j]) + (boundary[i - 1] if i else 0) + (boundary[j - 1] if j < n else 0)
                    for i, j in zip(edges, edges[1:]))
        best = min(best, worst)
    return best


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        k = rng.randint(1, n)
        costs = [rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(n)]
        boundary = [rng.uniform(0, 3) for _ in range(n - 1)]
        counts = partition(costs, k, boundary)
        assert len(counts) == k and sum(counts) == n and min(counts) >= 1
        edges = [0, *itertools.accumulate(counts)]
        got = max(sum(costs[i:j]) + (boundary[i - 1] if i else 0) + (boundary[j - 1] if j < n else 0)
                  for i, j in zip(edges, edges[1:]))
        assert got == pytest.approx(_brute_force(costs, k, boundary), abs=1e-12)


def test_boundary_cost_moves_the_cut():
    # Equal layers; the cut after layer 1 is expensive, so the best 2-way cut avoids it.
    assert partition([1, 1, 1, 1], 2) == [2, 2]
    assert partition([1, 1, 1, 1], 2, [0.0, 5.0, 0.0]) in ([1, 3], [3, 1])


def test_balance_time_isolates_a_heavy_layer():
    torch.manual_seed(0)
    light = [nn.Linear(16, 16) for _ in range(5)]
    heavy = nn.Sequential(nn.Linear(16, 1024), nn.Tanh(), nn.Linear(1024, 1024), nn.Tanh(), nn.Linear(1024, 16))
    before = [p.detach().clone() for p in heavy.parameters()]
    stages = mpmd.split(nn.Sequential(*light, heavy), num_stages=2, balance="time", sample=torch.randn(64, 16),
                        repeats=3, verbose=False)
    assert stages.layer_counts == [5, 1]
    assert len(stages.predicted_s) == 2 and stages.predicted_s[1] > stages.predicted_s[0]
    assert all(p.grad is None for p in heavy.parameters())  # measured on copies
    assert all(torch.equal(a, b) for a, b in zip(before, heavy.parameters(), strict=True))


def test_balance_time_with_the_loss_on_the_last_layer():
    layers = [nn.Linear(8, 8) for _ in range(4)]
    sample = (torch.randn(4, 8), torch.randn(4, 8))
    stages = mpmd.split(nn.Sequential(*layers), num_stages=2, balance="time", sample=sample, loss_fn=mse,
                        repeats=1, verbose=False)
    assert sum(stages.layer_counts) == 4 and len(stages.predicted_s) == 2
    with pytest.raises(ValueError, match=r"with loss_fn, sample must be a pair \(inputs, targets\)"):
        mpmd.split(nn.Sequential(*layers), num_stages=2, balance="time", sample=sample[0], loss_fn=mse)


def test_split_prints_a_table(capsys):
    mpmd.split(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), num_stages=2)
    out = capsys.readouterr().out
    assert "2 stages by balance='params'" in out and "params" in out


class _Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


class _Residual(_Chain):
    def forward(self, x):
        return x + self.b(self.a(x))


def test_module_whose_children_run_in_order_is_cut_with_a_sample():
    model = _Chain()
    stages = mpmd.split(model, num_stages=2, sample=torch.randn(2, 4), verbose=False)
    assert _children(stages) == [[model.a], [model.b]]


@pytest.mark.parametrize("sample", [None, torch.randn(2, 4)])
def test_model_that_cannot_be_cut(sample):
    with pytest.raises(ValueError, match=r"cannot cut _Residual.*explicit stages: mpmd.Pipeline\(\[stage0"):
        mpmd.split(_Residual(), num_stages=2, sample=sample)


def test_errors():
    layers = [nn.Linear(4, 4) for _ in range(3)]
    with pytest.raises(ValueError, match=r"num_stages=4 is more than the model.s 3 layers .*use num_stages <= 3"):
        mpmd.split(nn.Sequential(*layers), num_stages=4)
    marked = nn.Sequential(layers[0], mpmd.PipelineYield(), layers[1], layers[2])
    with pytest.raises(ValueError, match=r"num_stages=3 but the model's 1 PipelineYield markers make 2 stages"):
        mpmd.split(marked, num_stages=3)
    with pytest.raises(ValueError, match=r"markers, which already fix the stages; drop balance"):
        mpmd.split(marked, balance="params")
    with pytest.raises(ValueError, match=r"stage 0 would be empty"):
        mpmd.split(nn.Sequential(mpmd.PipelineYield(), *layers))
    with pytest.raises(ValueError, match=r"balance=\[1, 1\] covers 2 layers but the model has 3"):
        mpmd.split(nn.Sequential(*layers), balance=[1, 1])
    with pytest.raises(ValueError, match=r"num_stages=3 but balance=\[2, 1\] lists 2 stages"):
        mpmd.split(nn.Sequential(*layers), num_stages=3, balance=[2, 1])
    with pytest.raises(ValueError, match=r"positive number of layers for every stage"):
        mpmd.split(nn.Sequential(*layers), balance=[3, 0])
    with pytest.raises(ValueError, match=r"unknown balance 'flops'"):
        mpmd.split(nn.Sequential(*layers), num_stages=2, balance="flops")
    with pytest.raises(ValueError, match=r"split needs num_stages"):
        mpmd.split(nn.Sequential(*layers))
    with pytest.raises(ValueError, match=r"balance='time' measures each layer on a sample"):
        mpmd.split(nn.Sequential(*layers), num_stages=2, balance="time")


def test_split_model_trains_like_the_unsplit_model(ray_session):
    torch.manual_seed(0)
    layers = [Embed(6, 8), Block(8), Block(8), nn.GELU(), Block(8), Head(8, 3)]
    stages = mpmd.split(nn.Sequential(*layers), num_stages=2, balance="params", verbose=False)
    data = make_data(steps=3, batch=8)
    ref, ref_losses = reference_train(layers, data, num_microbatches=4, loss_fn=mse, optimizer=sgd)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=4, loss_fn=mse, optimizer=sgd,
                       device="cpu") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        got = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    want = ref.state_dict()
    assert len(got) == len(want)
    for (gk, g), (wk, w) in zip(got.items(), want.items(), strict=True):
        assert gk.split(".")[-1] == wk.split(".")[-1]
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
