"""``make gpu-check`` on a machine without CUDA stops at once and says why (the checks
themselves are tests/gpu, run there); its CUDA MPS start (scripts/mps.sh) counts a daemon
only once it answers, driven here by a fake ``nvidia-cuda-mps-control``."""

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



FAKE_MPS = """#!/usr/bin/env bash
# A fake nvidia-cuda-mps-control: -d "starts" the daemon (exit 0); it answers get_server_list
# only when $ANSWERS says so.
if [ "${1:-}" = "-d" ]; then echo started >> "$LOG"; exit 0; fi
read -r cmd
echo "$cmd" >> "$LOG"
[ "$cmd" = quit ] && exit 0
[ "$ANSWERS" = after-start ] && grep -q started "$LOG" && exit 0
exit 1
"""


@pytest.mark.parametrize("answers, says", [
    ("after-start", "started for this check"),
    ("never", "-d returned but the daemon never answered"),
])
def test_mps_counts_as_started_only_once_the_daemon_answers(tmp_path, answers, says):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "nvidia-cuda-mps-control"
    fake.write_text(FAKE_MPS)
    fake.chmod(0o755)
    log = tmp_path / "log"
    script = f". {REPO / 'scripts' / 'mps.sh'}; start_mps; echo \"MPS=$MPS\""
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log), "ANSWERS": answers,
                               "MPS_WAIT_S": "0.01"})
    assert done.returncode == 0, done
    assert says in done.stdout, done.stdout
    assert log.read_text().splitlines()[-1] == "quit"  # the daemon this check started is stopped at exit
