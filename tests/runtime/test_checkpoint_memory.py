"""What a tensor-parallel actor holds while it saves and loads a checkpoint, measured by the
kernel (peak resident size, VmHWM, reset before each phase), as a ratio of its share: its
shard's parameters, gradients and optimizer state (Note [checkpoint pieces] in actors/pieces.py).
Gathering the stage whole to save it, or reading whole files to load it, would take each actor
past 1.5 times its share; writing its own pieces and reading only its box stays well inside."""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import mpmd

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="peak RSS is read from /proc (Linux)")

WIDTH, LAYERS = 1024, 4  # per stage: 4 x 1024 x 1024 weights = 16 MB fp32; each TP rank holds half
PLAN = {str(i): (ColwiseParallel() if i % 2 == 0 else RowwiseParallel()) for i in range(LAYERS)}


def stage() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def adam(params):
    return torch.optim.Adam(params, lr=1e-3)


def growth(pipe, baseline: list, phase) -> list[float]:
    """Each actor's peak resident size during ``phase()`` above ``baseline`` (its resident size
    after the first step), as a multiple of its share."""
    pipe.engine.call_actors("memory_stats", reset=True, what="memory")
    phase()
    after = pipe.engine.call_actors("memory_stats", what="memory")
    return [(a["peak_rss_bytes"] - b["rss_bytes"]) / share(b) for a, b in zip(after, baseline)]


def share(m: dict) -> int:
    return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]


def test_a_tensor_parallel_actor_saves_and_loads_within_its_share(ray_session, tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    with mpmd.Pipeline([stage(), stage()], num_microbatches=2, loss_fn=F.mse_loss, optimizer=adam, tp=2,
                       tp_plan=PLAN, device="cpu", num_cpus=0.25) as pipe:
        pipe.step(x, y)  # Adam's state exists
        baseline = pipe.engine.call_actors("memory_stats", what="memory")
        assert all(m["params_bytes"] == LAYERS * WIDTH * WIDTH * 4 // 2 for m in baseline)  # each holds half
        saving = growth(pipe, baseline, lambda: pipe.save(tmp_path / "ck"))
        loading = growth(pipe, baseline, lambda: pipe.load(tmp_path / "ck"))
        loss = pipe.step(x, y)
    print(f"peak growth / share: save {[round(g, 2) for g in saving]}, load {[round(g, 2) for g in loading]}")
    assert max(saving) <= 0.5, saving  # its own pieces, written as they are
    assert max(loading) <= 1.25, loading  # its box of each tensor (and the file pages under it)
    assert torch.isfinite(torch.tensor(loss))
