"""examples/tensor_parallel.py runs (HF Llama, pp=2 x tp=2, 1F1B): the loss falls, each actor
holds about half of its stage's parameters, and ``pipe.state_dict()`` loads back into the
``transformers`` model (the example's own checks, its exit status)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "tensor_parallel.py"


def test_tensor_parallel_example(ray_session, capsys):
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location("tensor_parallel_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "3", "--num-cpus", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "4 actors: 2 pipeline ranks x tp=2" in out
    held = [float(kib) for kib in re.findall(r"TP rank \d\): params ([\d.]+) KiB", out)]
    whole = float(re.search(r"the whole model ([\d.]+) KiB", out).group(1))
    assert len(held) == 4 and sum(held) < 1.01 * whole  # each actor about a quarter: its stage's half
