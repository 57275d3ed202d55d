"""Data parallel x pipeline parallel: ``dp`` replicas equal one process on the global batch.

Each pipeline here is 2 ranks x dp 2 = 4 actors on the session Ray (CPU, gloo), trained
with SGD with momentum, so a replica average off by a factor (a sum for a mean) shows.
"""

from __future__ import annotations

import functools
import json
import re

import pytest
import torch
from torch.nn import functional as F

import mpmd
import schedules
from actors.buckets import bucket_tensors

from tests.models import make_data, make_stages, reference_train, sgd

DP = 2
STEPS = 3
BATCH = 16  # global: num_microbatches x DP microbatches of 2 samples
STAGES = {"gpipe": 2, "1f1b": 2, "interleaved-1f1b": 4, "zbv": 4}  # all on 2 ranks; zbv splits B into I and W
MICROBATCHES = 4
DEFAULT = None  # PipelineConfig's default bucket size


@functools.cache
def _train(schedule: str, bucket_bytes, overlap_reduce: bool = True):
    """Train 3 SGD steps; returns (losses, state_dict, number of actors)."""
    stages = make_stages(STAGES[schedule])
    options = {} if bucket_bytes is DEFAULT else {"bucket_bytes": bucket_bytes}
    options.update({} if overlap_reduce else {"overlap_reduce": False})
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


def test_overlapped_reduction_equals_the_reduction_after_the_backward(ray_session):
    """overlap_reduce=False averages each stage's gradients at its ALLREDUCE only, in forward
    order; overlapped, in reverse order from inside the backward: the same sums, bit for bit."""
    losses, state, _ = _train("1f1b", 64, overlap_reduce=False)
    base_losses, base_state, _ = _train("1f1b", 64)
    assert losses == base_losses
    for key, value in base_state.items():
        assert torch.equal(state[key], value), key


@pytest.mark.parametrize("schedule, zero, recompute", [
    ("1f1b", 0, False), ("zb-h1", 0, True), ("interleaved-1f1b", 0, False), ("zbv", 1, True), ("1f1b", 1, True)])
def test_bucket_averages_start_inside_the_last_backward(ray_session, tmp_path, schedule, zero, recompute):
    """Note [overlapped dp reduction]: with 64-byte buckets (several per stage), each stage's
    first bucket starts while its last backward of the step runs (B, or W when split: some of
    zb-h1's and zbv's), as its profiled DP_REDUCE slice shows; the result equals one process (ZeRO-1 too,
    and with the forward recomputed in B or at I)."""
    num_stages = {**STAGES, "zb-h1": 2}[schedule]
    ((x, y),) = make_data(1, BATCH)
    with mpmd.Pipeline(make_stages(num_stages), schedule=schedule, num_microbatches=MICROBATCHES,
                       loss_fn=F.mse_loss, optimizer=sgd, dp=DP, zero=zero, device="cpu", bucket_bytes=64,
                       recompute=recompute) as pipe:
        report = pipe.profile(x, y, steps=1)  # 2 ordinary steps, then the profiled one
        state = pipe.state_dict()
        ends = {a.stage: a.kind.name for acts in pipe.schedule.ranks for a in acts if a.kind.name in ("B", "W")}
    model, _ = reference_train(make_stages(num_stages), [(x, y)] * 3, num_microbatches=MICROBATCHES * DP,
                               loss_fn=F.mse_loss, optimizer=sgd)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    last, reduced = {}, {}  # (actor, stage) -> its last backward's slice; its reduction's slice
    for s in sorted(report.slices, key=lambda s: s.start_ns):
        if s.kind in ("B", "W"):
            last[(s.actor, schedules.Action.parse(s.name).stage)] = s
        elif s.kind == "DP_REDUCE":
            reduced[(s.actor, int(re.fullmatch(r"(\d+)DP_REDUCE", s.name).group(1)))] = s
    assert set(reduced) == set(last) and len(last) == DP * num_stages
    for key, s in reduced.items():
        assert last[key].start_ns <= s.start_ns < last[key].end_ns <= s.end_ns, (key, s, last[key])
        assert last[key].kind == ends[key[1]]  # B, or W where that backward is split (schedules/fuse.py)
    assert ("W" in ends.values()) == schedule.startswith("zb")
    report.save_chrome_trace(tmp_path / "trace.json")
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    tracks = {e["tid"] for e in events if e["name"].endswith("DP_REDUCE")}
    assert tracks == {report.num_actors + a for a, _ in reduced}  # a track of their own per actor


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
