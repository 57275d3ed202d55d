"""Actors kept between pipelines (``mpmd.reuse_actors``, Note [reused actors]): a pipeline on
parked and rebound processes trains exactly as one on fresh processes, a failed pipeline's
actors are not kept, and a rebound actor's peak memory is its own pipeline's."""

from __future__ import annotations

import copy

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import make_data, make_stages, reference_train, sgd
from tests.mpmd.runtime.test_failures import wait_processes_gone

BATCH, MICROBATCHES = 8, 4


def dropout_stages() -> list[nn.Module]:
    """Dropout draws from each actor's RNG, which its constructor seeds: a rebound actor must
    draw what a fresh one draws."""
    stages = make_stages(2)
    stages[0] = nn.Sequential(stages[0], nn.Dropout(0.3))
    return stages


def train(stages, data) -> tuple[list[float], dict, list[int]]:
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=sgd) as pipe:
        pids = ray.get([a.pid.remote() for a in pipe.actors])
        losses = [pipe.step(*batch) for batch in data]
        return losses, pipe.state_dict(), pids


def test_rebound_actors_train_bit_identically_to_fresh_ones(ray_session):
    data = make_data(3, BATCH)
    with mpmd.reuse_actors(max_idle=0):
        fresh_losses, fresh_state, fresh_pids = train(dropout_stages(), data)
    with mpmd.reuse_actors(max_idle=8) as pool:
        first_losses, _, first_pids = train(dropout_stages(), data)
        assert len(pool) == 2 and pool.parked == 2
        again_losses, again_state, again_pids = train(dropout_stages(), data)
        assert sorted(again_pids) == sorted(first_pids) and pool.taken == 2
    assert not set(first_pids) & set(fresh_pids)
    assert first_losses == fresh_losses and again_losses == fresh_losses
    for key, value in fresh_state.items():
        assert torch.equal(again_state[key], value), key
    assert len(pool) == 0  # leaving the block killed the idle actors
    assert wait_processes_gone(again_pids) == []


def test_a_failed_pipelines_actors_are_killed_not_kept(ray_session):
    with mpmd.reuse_actors(max_idle=8) as pool:
        pipe = mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd)
        handles = list(pipe.actors)
        ray.kill(handles[1])
        with pytest.raises(mpmd.ActorDiedError):
            for batch in make_data(50, 4):
                pipe.step(*batch)
        pipe.shutdown()
        assert len(pool) == 0 and pool.parked == 0
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handles[0].pid.remote(), timeout=60)


def test_a_rebound_actors_peak_memory_is_its_own_pipelines(ray_session):
    """memory_stats reads the kernel's VmHWM, which a rebind starts again: the small pipeline
    does not report the large one's peak."""
    big = [nn.Linear(4, 2048), nn.Sequential(nn.Linear(2048, 4096), nn.Linear(4096, 2048), nn.Linear(2048, 3))]
    x, y = torch.randn(4, 4), torch.randn(4, 3)
    with mpmd.reuse_actors(max_idle=8) as pool:
        with mpmd.Pipeline(big, num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd) as pipe:
            large = pipe.profile(x, y, steps=1).peak_memory_bytes
        with mpmd.Pipeline(make_stages(2, d_in=4), num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd) as pipe:
            small = pipe.profile(x, y, steps=1).peak_memory_bytes
        assert pool.taken == 2
    held = 3 * (2048 * 4096 * 2) * 4  # the second stage's weights, gradients and momentum: 201 MB
    assert large[1] > held
    assert max(small) < large[1] - held / 2, (small, large)


def test_max_idle_is_checked():
    with pytest.raises(ValueError, match="max_idle must be an int >= 0"):
        mpmd.reuse_actors(max_idle=-1)


def test_a_tensor_parallel_pipeline_on_the_last_ones_processes_trains_as_one_process(ray_session):
    """DTensor's process-wide caches compare meshes by ranks and names, not process groups.  A
    tied Llama after an untied one on the same 4 processes forms a tie group before its TP
    groups, so the TP groups' names move: found in those caches, the first pipeline's meshes
    would run the second one's TP collectives on its tie group (the name the old TP group had).
    Each mesh is named anew (tp_mesh), and the tied pipeline trains as one process does."""
    from mpmd.planning import causal_lm_loss
    from tests.mpmd.tensor_parallel.test_tensor_parallel import (LogitsOnly, MICROBATCHES, batches, llama_case,
                                                                  reference, train)

    data = batches(64, 2 * MICROBATCHES, steps=2)
    with mpmd.reuse_actors(max_idle=8) as pool:
        train(llama_case(2, tied=False)[1], data[:1], causal_lm_loss, sgd)
        assert pool.parked == 4
        model, stages = llama_case(2, tied=True)
        losses, _, _, _ = train(stages, data, causal_lm_loss, sgd)
        assert pool.taken == 4
    _, ref_losses = reference(None, data, MICROBATCHES, causal_lm_loss, sgd, model=LogitsOnly(copy.deepcopy(model)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
