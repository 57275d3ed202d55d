"""Data parallel x pipeline parallel: ``dp`` replicas equal one process on the global batch.

Each pipeline here is 2 ranks x dp 2 = 4 actors on the session Ray (CPU, gloo), trained
with SGD with momentum, so a replica average off by a factor (a sum for a mean) shows.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.nn import functional as F

import mpmd
from actors.comm import bucket_tensors

from tests.models import make_data, make_stages, reference_train, sgd

DP = 2
STEPS = 3
BATCH = 16  # global: num_microbatches x DP microbatches of 2 samples
STAGES = {"gpipe": 2, "1f1b": 2, "interleaved-1f1b": 4, "zbv": 4}  # all on 2 ranks; zbv splits B into I and W
MICROBATCHES = 4
DEFAULT = None  # PipelineConfig's default bucket size


@functools.cache
def _train(schedule: str, bucket_bytes):
    """Train 3 SGD steps; returns (losses, state_dict, number of actors)."""
    stages = make_stages(STAGES[schedule])
    options = {} if bucket_bytes is DEFAULT else {"bucket_bytes": bucket_bytes}
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=sgd, dp=DP, device="cpu", **options) as pipe:
        losses = [pipe.step(x, y) for x, y in make_data(STEPS, BATCH)]
        return losses, pipe.state_dict(), len(pipe.actors)


@pytest.mark.parametrize("schedule", list(STAGES))
def test_dp2_equals_single_process_on_the_global_batch(ray_session, schedule):
    losses, state, num_actors = _train(schedule, DEFAULT)
    assert num_actors == 2 * DP
    model, ref_losses = reference_train(make_stages(STAGES[schedule]), make_data(STEPS, BATCH),
                                        num_microbatches=MICROBATCHES * DP, loss_fn=F.mse_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    ref = model.state_dict()
    assert list(state) == list(ref)
    for key, value in ref.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    # Training moved the parameters: the comparison is not trivially between initial weights.
    init = torch.nn.Sequential(*make_stages(STAGES[schedule])).state_dict()
    assert any(not torch.equal(init[k], state[k]) for k in init)


@pytest.mark.parametrize("bucket_bytes", [64, 0], ids=["64-byte-buckets", "per-tensor"])
def test_bucket_size_does_not_change_the_result(ray_session, bucket_bytes):
    losses, state, _ = _train("1f1b", bucket_bytes)
    base_losses, base_state, _ = _train("1f1b", DEFAULT)
    assert losses == base_losses
    for key, value in base_state.items():
        assert torch.equal(state[key], value), key


def test_buckets_are_few_large_messages():
    grads = [p.detach().clone() for p in torch.nn.Sequential(*make_stages(4, d=64)).parameters()]
    sizes = [g.numel() * 4 for g in grads]
    assert len(bucket_tensors(grads, 4 << 20)) == 1  # the default: one message for the whole stage
    assert len(bucket_tensors(grads, 0)) == len(grads)  # unbucketed: one per tensor
    tiny = bucket_tensors(grads, 512)
    assert 1 < len(tiny) < len(grads)
    flat = [t for b in tiny for t in b]
    assert len(flat) == len(grads) and all(a is b for a, b in zip(flat, grads, strict=True))  # order kept
    for bucket in tiny:
        assert len(bucket) == 1 or sum(t.numel() * 4 for t in bucket) <= 512
    assert max(sizes) > 512  # a tensor larger than the bucket travels alone
