"""``python -m mpmd bench ckpt`` on a tiny model: both paths are measured, and every
checkpoint, whichever path wrote it, loads by either path to the state it was saved from
(SGD with momentum, so optimizer buffers are checked too).  Correctness only: the timings
are the benchmark's to print, not a test's to assert."""

from __future__ import annotations

import pytest
import torch

from mpmd.cli import main
from benchmarks.bench_ckpt import PATHS, BigStage, format_results, measure_config, model_shape, same_state


def test_bench_ckpt_measures_both_paths_and_their_checkpoints_load_to_the_saved_state(ray_session, tmp_path):
    result = measure_config(2e6, 2, 1, str(tmp_path / "ckpts"), momentum=0.9, check=True)
    assert result.width * result.width * result.layers * result.actors == result.params
    assert set(result.measures) == set(PATHS) and all(len(ms) == 1 for ms in result.measures.values())
    assert result.ckpt_bytes > 2 * 4 * result.params  # weights and momentum buffers, float32
    assert len(result.checks) == 6 and all(result.checks.values()), result.checks
    table = "\n".join(format_results([result]))
    for path, op in PATHS:
        assert any(line.split()[2:4] == [path, op] for line in table.splitlines() if line.strip()), table
    assert "6/6 loads gave back the saved state" in table


def test_bench_model_shapes_and_state_comparison():
    assert model_shape(800e6, 4) == (4096, 12) and model_shape(100e6, 4) == (4992, 1)
    assert model_shape(1e6, 4) == (512, 1) and model_shape(10, 4) == (64, 1)
    assert sum(p.numel() for p in BigStage(64, 3).parameters()) == 3 * 64 * 64
    assert same_state({"a": [torch.ones(2), 1]}, {"a": [torch.ones(2), 1]})
    assert not same_state({"a": [torch.ones(2), 1]}, {"a": [torch.ones(2), 2]})
    assert not same_state({"a": torch.ones(2)}, {"a": torch.ones(2, dtype=torch.float64)})


def test_bench_ckpt_refuses_bad_sizes():
    with pytest.raises(SystemExit, match="--params takes sizes such as 200e6,800e6"):
        main(["bench", "ckpt", "--params", "big"])
    with pytest.raises(SystemExit, match="--params must be positive"):
        main(["bench", "ckpt", "--params", "0"])
