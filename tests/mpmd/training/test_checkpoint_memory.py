"""What a tensor-parallel actor holds while it saves and loads a checkpoint, measured by the
kernel (peak resident size, VmHWM, reset before each phase), as a ratio of its share: its
shard's parameters, gradients and optimizer state (Note [checkpoint pieces] in actors/pieces.py).
Gathering the stage whole to save it, or reading whole files to load it, would take each actor
past 1.5 times its share; writing its own pieces and reading only its box stays well inside."""
from __future__ import annotations

import os
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
    pipe.engine.client.memory_stats(reset=True, what="memory")
    phase()
    after = pipe.engine.client.memory_stats(what="memory")
    return [(a["peak_rss_bytes"] - b["rss_bytes"]) / share(b) for a, b in zip(after, baseline)]


def share(m: dict) -> int:
    return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]


def test_a_tensor_parallel_actor_saves_and_loads_within_its_share(ray_session, tmp_path):
    torch.manual_seed(0)
    x, y = torch.randn(8, WIDTH), torch.randn(8, WIDTH)
    with mpmd.Pipeline([stage(), stage()], num_microbatches=2, loss_fn=F.mse_loss, optimizer=adam, tp=2,
                       tp_plan=PLAN, device="cpu", num_cpus=0.25) as pipe:
        pipe.step(x, y)  # Adam's state exists
        baseline = pipe.engine.client.memory_stats(reset=True, what="memory")  # the heap trimmed
        assert all(m["params_bytes"] == LAYERS * WIDTH * WIDTH * 4 // 2 for m in baseline)  # each holds half
        saving = growth(pipe, baseline, lambda: pipe.save(tmp_path / "ck"))
        loading = growth(pipe, baseline, lambda: pipe.load(tmp_path / "ck"))
        loss = pipe.step(x, y)
    print(f"peak growth / share: save {[round(g, 2) for g in saving]}, load {[round(g, 2) for g in loading]}")
    assert max(saving) <= 0.5, saving  # its own pieces, written as they are
    assert max(loading) <= 1.25, loading  # its box of each tensor (and the file pages under it)
    assert torch.isfinite(torch.tensor(loss))


def factory() -> nn.Module:
    return stage()


def test_the_controller_holds_no_weights_while_exporting_or_loading(ray_session, tmp_path):
    """The controller's peak resident growth (its own VmHWM, restarted) while the actors export
    the model and while ``Pipeline.load`` rebuilds it from factories and a checkpoint stays a
    small fraction of the model's bytes; ``state_dict()``, the whole-model path, is measured
    beside them and is over the whole model."""
    from actors.probes import peak_rss_bytes, reset_peak_rss

    def growth(work) -> int:
        reset_peak_rss()
        with open("/proc/self/statm") as f:
            before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        work()
        return peak_rss_bytes() - before

    options = dict(num_microbatches=2, loss_fn=F.mse_loss, optimizer=adam, tp=2, tp_plan=PLAN, device="cpu",
                   num_cpus=0.25)
    model_bytes = 2 * LAYERS * WIDTH * WIDTH * 4
    with mpmd.Pipeline([factory, factory], **options) as pipe:
        pipe.step(torch.randn(8, WIDTH), torch.randn(8, WIDTH))
        path = pipe.save(tmp_path / "ck")
        exporting = growth(lambda: pipe.export_safetensors(tmp_path / "hf"))
        state = {}
        gathering = growth(lambda: state.update(pipe.state_dict()))
    del state
    holder = []
    loading = growth(lambda: holder.append(mpmd.Pipeline.load(path, stages=[factory, factory], **options)))
    holder.pop().shutdown()
    print(f"controller growth / model: export {exporting / model_bytes:.3f}, load {loading / model_bytes:.3f}, "
          f"state_dict {gathering / model_bytes:.2f}")
    assert gathering > 0.5 * model_bytes  # the measurement sees a whole model arriving
    assert exporting < 0.1 * model_bytes and loading < 0.1 * model_bytes, (exporting, loading, model_bytes)
