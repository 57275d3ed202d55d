"""Warm spare actors (``spare_actors=N``, Note [spare actors]): a restart after a killed
actor uses the spares instead of new processes, starts new spares, and still trains
exactly like the uninterrupted run."""

from __future__ import annotations

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import adamw, make_data, make_stages
from tests.mpmd.runtime.test_failures import equal_states, wait_processes_gone, wait_until_dead

DATA = make_data(6, 8)


def test_restart_uses_the_spares_and_equals_the_uninterrupted_run(ray_session, tmp_path):
    stages = make_stages(2)
    stages[0] = nn.Sequential(stages[0], nn.Dropout(0.25))  # the actors' RNG states must come back too
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=adamw,
                       device="cpu", spare_actors=2) as pipe:
        start = pipe.save(tmp_path / "start")
        expected_history = pipe.fit(DATA, progress=False)
        expected = pipe.state_dict()
        pipe.load(start)
        first_actors = list(pipe.actors)
        spares = dict(pipe.engine.fleet.spares.spares)
        assert sorted(spares) == [0, 1] and not set(spares.values()) & set(first_actors)
        ray.get([s.pid.remote() for s in spares.values()])  # warm: started before the kill

        def kills_rank_1_before_step_3():
            for i, batch in enumerate(DATA):
                if i == 3:
                    ray.kill(first_actors[1])
                    wait_until_dead(first_actors[1])
                yield batch

        with pytest.warns(UserWarning, match=r"restarting the pipeline's actors \(1 of max_restarts=1\)"):
            history = pipe.fit(kills_rank_1_before_step_3(), checkpoint_dir=tmp_path / "run", checkpoint_every=2,
                               max_restarts=1, progress=False)
        assert list(pipe.actors) == [spares[0], spares[1]]  # the spares, each in its own place
        refilled = dict(pipe.engine.fleet.spares.spares)
        assert sorted(refilled) == [0, 1] and not set(refilled.values()) & (set(spares.values()) | set(first_actors))
        assert history == expected_history
        assert equal_states(pipe.state_dict(), expected)
        spare_pids = ray.get([s.pid.remote() for s in refilled.values()])
    assert wait_processes_gone(spare_pids) == []  # shutdown takes the spares too


def test_a_dead_spare_is_replaced_by_a_new_process(ray_session, tmp_path):
    torch.manual_seed(0)
    with mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=adamw,
                       device="cpu", spare_actors=1) as pipe:
        start = pipe.save(tmp_path / "start")
        expected_history = pipe.fit(DATA, progress=False)
        pipe.load(start)
        first_actors, spare = list(pipe.actors), pipe.engine.fleet.spares.spares[0]
        ray.kill(spare)
        wait_until_dead(spare)

        def kills_rank_0_before_step_3():
            for i, batch in enumerate(DATA):
                if i == 3:
                    ray.kill(first_actors[0])
                    wait_until_dead(first_actors[0])
                yield batch

        with pytest.warns(UserWarning, match=r"restarting the pipeline's actors"):
            history = pipe.fit(kills_rank_0_before_step_3(), checkpoint_dir=tmp_path / "run", checkpoint_every=2,
                               max_restarts=1, progress=False)
        assert spare not in pipe.actors and not set(pipe.actors) & set(first_actors)
        assert history == expected_history


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_spare_actors_must_be_a_count(value):
    with pytest.raises(ValueError, match="spare_actors must be an integer >= 0"):
        mpmd.Pipeline(make_stages(2), loss_fn=F.mse_loss, device="cpu", spare_actors=value)


def test_more_spares_than_actors_is_refused():
    with pytest.raises(ValueError, match=r"spare_actors=3 but the pipeline has 2 actors"):
        mpmd.Pipeline(make_stages(2), loss_fn=F.mse_loss, device="cpu", spare_actors=3)
