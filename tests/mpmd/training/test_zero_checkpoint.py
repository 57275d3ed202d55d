"""Checkpoints that reshard: each replica writes its shard of the optimizer state under
``zero=1``, and a checkpoint loads under any ``dp``, ``zero`` and actor layout, continuing as
one uninterrupted single-process run would (Note [ZeRO-1 sharding] in actors/zero.py)."""

from __future__ import annotations

import os
import warnings

import torch
from torch.nn import functional as F

import mpmd

from tests.models import adamw, assert_trained_like_reference, make_data, make_stages

GLOBAL_MICROBATCHES = 4  # dp x num_microbatches in every phase: the same microbatches each time
# (schedule, num_actors, dp, zero): dp=4 on one actor holding both stages, then dp=2 on two
# actors, dp=1 without sharding, and back to dp=2 sharded: resharding down and up, both ways.
PHASES = [("interleaved-1f1b", 1, 4, 1), ("1f1b", 2, 2, 1), ("1f1b", 2, 1, 0), ("1f1b", 2, 2, 1)]
STEPS = 2


def test_a_zero1_checkpoint_reshards_down_and_up_and_continues_like_one_process(ray_session, tmp_path):
    stages = make_stages(2, d=16)
    data = make_data(STEPS * len(PHASES), 2 * GLOBAL_MICROBATCHES)
    losses, path = [], None
    for i, (schedule, num_actors, dp, zero) in enumerate(PHASES):
        options = dict(schedule=schedule, num_actors=num_actors, dp=dp, zero=zero,
                       num_microbatches=GLOBAL_MICROBATCHES // dp, loss_fn=F.mse_loss, optimizer=adamw, device="cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # another layout: the actors' RNGs start fresh (no dropout here)
            pipe = (mpmd.Pipeline(stages, **options) if path is None
                    else mpmd.Pipeline.load(path, stages=make_stages(2, d=16, seed=9), **options))
        with pipe:
            losses += [pipe.step(x, y) for x, y in data[i * STEPS:(i + 1) * STEPS]]
            path = pipe.save(tmp_path / f"phase-{i}")
            params = list(pipe.state_dict().values())
        names = sorted(os.listdir(path))
        shards = [n for n in names if n.startswith("optim-")]
        assert len(shards) == (2 * dp if zero else 0), names  # one per stage and replica, written by that replica
    assert_trained_like_reference(losses, params, stages, data, GLOBAL_MICROBATCHES, F.mse_loss, adamw)


def test_the_same_layout_resumes_bit_identical(ray_session, tmp_path):
    stages, data = make_stages(2, d=16), make_data(4, 2 * GLOBAL_MICROBATCHES)
    options = dict(num_microbatches=2, loss_fn=F.mse_loss, optimizer=adamw, device="cpu", dp=2, zero=1)
    with mpmd.Pipeline(stages, **options) as pipe:
        for x, y in data[:2]:
            pipe.step(x, y)
        path = pipe.save(tmp_path / "ck")
        later = [pipe.step(x, y) for x, y in data[2:]]
        expected = pipe.state_dict()
    with mpmd.Pipeline.load(path, stages=make_stages(2, d=16, seed=9), **options) as resumed:
        again = [resumed.step(x, y) for x, y in data[2:]]
        state = resumed.state_dict()
    assert again == later
    assert all(torch.equal(state[k], v) for k, v in expected.items())
