"""``fit`` on a ``ray.data.Dataset``: the actors of the first and last stages pull their rows
from ``streaming_split`` iterators themselves (Note [fed steps] in actors/feed.py).  Each run
is compared with ``fit`` on the same rows as tensors and with single-process training."""

from __future__ import annotations

import glob

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import mpmd

from tests.models import make_data, make_stages, reference_train, sgd
from tests.mpmd.training.recording import RecordingEmbed

MICROBATCHES = 2
BATCH = 8


@pytest.fixture(scope="module")
def ray_data(ray_session):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    return ray.data


def rows_of(data) -> list[dict]:
    return [{"x": x.numpy(), "y": y.numpy()} for inputs, targets in data for x, y in zip(inputs, targets)]


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("schedule, num_stages", [("1f1b", 2), ("zbv", 4)])  # targets sent on / kept (V shape)
def test_fit_on_a_dataset_equals_fit_on_the_same_tensors(ray_data, schedule, num_stages):
    data = make_data(5, BATCH)
    ds = ray_data.from_items(rows_of(data))
    options = dict(schedule=schedule, num_actors=2, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                   optimizer=sgd, device="cpu")
    stages = make_stages(num_stages)
    with mpmd.Pipeline(stages, **options) as pipe:
        fed = pipe.fit(ds, batch_size=BATCH, columns=("x", "y"), epochs=2, progress=False)
        assert pipe.engine.last_dispatch.bare == 2  # no actor got data from the controller
        fed_state = pipe.state_dict()
    with mpmd.Pipeline(stages, **options) as pipe:
        plain = pipe.fit(data, epochs=2, progress=False)
        plain_state = pipe.state_dict()
    assert list(fed) == list(plain) and len(fed) == 10
    assert equal_states(fed_state, plain_state)
    assert [r["samples"] for r in fed.records] == [BATCH] * 10
    model, losses = reference_train(stages, data + data, MICROBATCHES, F.mse_loss, optimizer=sgd)
    assert np.allclose(fed, losses, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        assert torch.allclose(fed_state[k], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("zero", [0, 1])  # zero=1: the replicas' fed gradients reduce-scattered, shards stepped
def test_each_replica_pulls_its_own_split_and_the_step_averages_them(ray_data, tmp_path, zero):
    """dp=2: Ray Data decides which rows each replica's split holds, so the first stage records
    the row ids it trains on (a column of the inputs it drops); the reference then trains on
    each step's rows of both replicas, in one process."""
    data = make_data(6, BATCH, d_in=6)
    ids = torch.arange(6 * BATCH, dtype=torch.float32)
    rows = [{"x": np.append(r["x"], ids[i].item()).astype(np.float32), "y": r["y"]}
            for i, r in enumerate(rows_of(data))]
    stages = make_stages(4)
    recording = [RecordingEmbed(stages[0], str(tmp_path / "ids")), *stages[1:]]
    with mpmd.Pipeline(recording, schedule="interleaved-1f1b", dp=2, zero=zero, num_microbatches=MICROBATCHES,
                       loss_fn=F.mse_loss, optimizer=sgd, device="cpu") as pipe:
        fed = pipe.fit(ray_data.from_items(rows), batch_size=BATCH, columns=("x", "y"), progress=False)
        state = pipe.state_dict()
    assert len(fed) == 6

    per_replica = [np.loadtxt(f, ndmin=1).astype(int).reshape(6, BATCH // 2)
                   for f in sorted(glob.glob(str(tmp_path / "ids-*")))]
    assert len(per_replica) == 2
    seen = np.concatenate([r.reshape(-1) for r in per_replica])
    assert sorted(seen.tolist()) == list(range(6 * BATCH))  # every row once
    inputs = torch.cat([x for x, _ in data])
    targets = torch.cat([y for _, y in data])
    steps = []
    for k in range(6):
        order = torch.as_tensor(np.concatenate([r[k] for r in per_replica]))
        steps.append((inputs[order], targets[order]))
    model, losses = reference_train(stages, steps, 2 * MICROBATCHES, F.mse_loss, optimizer=sgd)
    assert np.allclose(fed, losses, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        key = "0.inner." + k[2:] if k.startswith("0.") else k
        assert torch.allclose(state[key], v, rtol=1e-5, atol=1e-6), k


@pytest.mark.parametrize("sharding", [{}, dict(dp=2, zero=1)], ids=["dp1", "dp2-zero1"])
def test_fit_on_a_dataset_resumes_past_the_rows_it_had_consumed(ray_data, tmp_path, sharding):
    data = make_data(4, BATCH)
    ds = ray_data.from_items(rows_of(data))
    options = dict(num_actors=2, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu",
                   **sharding)
    with mpmd.Pipeline(make_stages(2), **options) as pipe:
        whole = pipe.fit(ds, batch_size=BATCH, columns=("x", "y"), epochs=2, progress=False)
        whole_state = pipe.state_dict()
    with mpmd.Pipeline(make_stages(2), **options) as pipe:
        pipe.fit(ds, batch_size=BATCH, columns=("x", "y"), progress=False, checkpoint_dir=tmp_path)
    with mpmd.Pipeline(make_stages(2), **options) as pipe:  # a new process would do the same
        resumed = pipe.fit(ds, batch_size=BATCH, columns=("x", "y"), epochs=2, progress=False,
                           checkpoint_dir=tmp_path)
        assert list(resumed) == list(whole)
        assert equal_states(pipe.state_dict(), whole_state)


def test_tensor_parallel_stages_share_the_rows_one_rank_pulls(ray_data):
    """tp=2: TP rank 0 of the first stage pulls the rows and broadcasts them to its TP peer,
    and each TP rank sends the targets to its peer of the last stage (Note [fed steps]):
    the same training as ``fit`` on the same tensors."""
    from mpmd.models import GPTConfig, gpt_stages, lm_loss

    stages = gpt_stages(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2), 2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 32, (BATCH, 8), generator=g), torch.randint(0, 32, (BATCH, 8), generator=g))
            for _ in range(3)]
    options = dict(num_actors=2, num_microbatches=MICROBATCHES, loss_fn=lm_loss, optimizer=sgd, device="cpu", tp=2,
                   tp_plan="auto", num_cpus=0.25)
    with mpmd.Pipeline(stages, **options) as pipe:
        fed = pipe.fit(ray_data.from_items(rows_of(data)), batch_size=BATCH, columns=("x", "y"), progress=False)
        assert pipe.engine.last_dispatch.bare == 4  # no actor got data from the controller
        fed_state = pipe.state_dict()
    with mpmd.Pipeline(stages, **options) as pipe:
        plain = pipe.fit(data, progress=False)
        plain_state = pipe.state_dict()
    assert list(fed) == list(plain) and len(fed) == 3
    assert equal_states(fed_state, plain_state)


def test_fit_on_a_dataset_refuses_what_it_cannot_do(ray_data):
    ds = ray_data.from_items(rows_of(make_data(2, BATCH)))
    with mpmd.Pipeline(make_stages(2), num_actors=2, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=sgd, device="cpu") as pipe:
        with pytest.raises(ValueError, match=r"needs batch_size, the rows of one step"):
            pipe.fit(ds, columns=("x", "y"))
        with pytest.raises(ValueError, match=r"batch_size=7 does not split into num_microbatches=2 x dp=1"):
            pipe.fit(ds, batch_size=7, columns=("x", "y"))
        with pytest.raises(ValueError, match=r"the dataset has no column 'inputs' \(its columns: \['x', 'y'\]\)"):
            pipe.fit(ds, batch_size=BATCH)
        with pytest.raises(ValueError, match=r"make no step of batch_size=64"):
            pipe.fit(ds, batch_size=64, columns=("x", "y"))
        with pytest.raises(ValueError, match=r"max_restarts is not supported with a ray.data.Dataset"):
            pipe.fit(ds, batch_size=BATCH, columns=("x", "y"), max_restarts=1, checkpoint_dir="unused",
                     checkpoint_every=2)
        with pytest.raises(ValueError, match=r"batch_size is for fit on a ray.data.Dataset"):
            pipe.fit(make_data(1, BATCH), batch_size=BATCH)
        assert len(pipe.fit(ds, batch_size=BATCH, columns=("x", "y"), progress=False)) == 2  # still trains
