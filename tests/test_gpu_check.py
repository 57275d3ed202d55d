"""``make gpu-check`` on a machine without CUDA stops at once and says why (the checks
themselves are tests/gpu, run there)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: make gpu-check runs for real here")
def test_gpu_check_fails_fast_without_cuda(tmp_path):
    report = tmp_path / "report.md"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu-check.sh")], capture_output=True, text=True,
                          timeout=120, env={"PYTHON": sys.executable, "REPORT": str(report), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 2, done
    assert "gpu-check: no CUDA device here" in done.stderr and "on a machine with an NVIDIA GPU" in done.stderr
    assert not report.exists()  # nothing ran

