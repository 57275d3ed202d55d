"""One Ray instance per test session; actor tests run on CPU with gloo."""

from __future__ import annotations

import os
import pathlib

import pytest

TESTS = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        # Actors import the test's model classes (tests/models.py) by module name.
        path = os.pathsep.join([str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}})
    yield ray
    ray.shutdown()
