"""One Ray instance per test session; actor tests run on CPU with gloo.

The tests mirror the packages: ``tests/schedules`` (no torch, no Ray), ``tests/actors`` (inside
one actor, no Ray), ``tests/mpmd/<room>`` for each room of mpmd (most with Ray actors, the
session's one Ray below); ``tests/models.py`` (the models and the single-process ``Reference``)
and ``tests/fill_jobs.py`` hold what the actors import by name."""

from __future__ import annotations

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from mpmd.runtime.devices import local_gpus

    if not ray.is_initialized():
        # Actors import the tests' model classes (tests.models) by module name.
        path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=8, num_gpus=local_gpus(), include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    import mpmd

    # Note [reused actors] in mpmd/runtime/pool.py: a pipeline that shuts down cleanly leaves
    # its processes to the next, so the suite pays for starting an actor a few dozen times,
    # not once per actor of every pipeline; ``fresh_actors`` opts a test out.
    with mpmd.reuse_actors(max_idle=8):
        yield ray
    ray.shutdown()


@pytest.fixture
def fresh_actors(ray_session):
    """Pipelines started in this test get new processes (and park none)."""
    import mpmd

    with mpmd.reuse_actors(max_idle=0):
        yield ray_session
