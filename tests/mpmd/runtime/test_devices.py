"""``device="auto"`` and each actor's GPU share (mpmd/runtime/devices.py), its memory limit
(actors/place.py ``limit_memory``), and the CUDA hint in an actor's error (actors/errors.py).
No GPU needed: the GPU count is passed in."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from actors.errors import cuda_hint, instruction_error
from actors.program import Instr
from actors.place import cuda_index, limit_memory
from mpmd.runtime.devices import Placement, memory_fraction, resolve_device
from schedules import Kind


def test_auto_counts_fractional_gpus_and_shares_them():
    assert resolve_device("auto", None, 2, gpus=1) == Placement("cuda", 0.5, 0.5)  # one GPU, two actors: shared
    assert resolve_device("auto", None, 3, gpus=1) == Placement("cuda", 0.3333, 0.3333)
    assert resolve_device("auto", None, 4, gpus=8) == Placement("cuda", 1.0, 1.0)
    assert resolve_device("auto", None, 4, gpus=4) == Placement("cuda", 1.0, 1.0)
    assert resolve_device("auto", None, 3, gpus=0) == Placement("cpu", 0.0, 1.0)
    assert resolve_device("auto", 1.0, 2, gpus=1) == Placement("cpu", 0.0, 1.0)  # whole GPUs asked, one there
    assert resolve_device("auto", 0.25, 4, gpus=1) == Placement("cuda", 0.25, 0.25)
    assert resolve_device("cuda", None, 2, gpus=1) == Placement("cuda", 0.5, 0.5)
    assert resolve_device("cuda", None, 2, gpus=0).num_gpus == 1.0  # placement then says what is missing
    assert resolve_device("cpu", None, 2, gpus=8) == Placement("cpu", 0.0, 1.0)
    assert [memory_fraction(g) for g in (0.0, 0.5, 1.0, 2.0)] == [1.0, 0.5, 1.0, 1.0]


def test_memory_is_limited_only_on_a_shared_gpu(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d)))
    assert limit_memory(torch.device("cpu"), 0.5) == 1.0 and calls == []
    assert limit_memory(torch.device("cuda", 0), 1.0) == 1.0 and calls == []
    assert limit_memory(torch.device("cuda", 0), 0.5) == 0.5 and calls == [(0.5, torch.device("cuda", 0))]


def test_a_cuda_error_says_to_rerun_with_cuda_launch_blocking(monkeypatch):
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    err = instruction_error(RuntimeError("CUDA error: an illegal memory access was encountered"), rank=1, replica=0,
                            step=3, program_name="train", program=[Instr(Kind.F, 1, 0)], index=0)
    assert "rerun with CUDA_LAUNCH_BLOCKING=1" in str(err) and "rank 1 (replica 0), stage 1, step 3" in str(err)
    assert cuda_hint(ValueError("shapes (2, 3) and (4, 5) do not match")) == ""
    # Over NCCL every launch made synchronous would hang a send in its launch: no such advice there.
    nccl = instruction_error(RuntimeError("CUDA error: an illegal memory access was encountered"), rank=1, replica=0,
                             step=3, program_name="train", program=[Instr(Kind.F, 1, 0)], index=0, nccl=True)
    assert "rerun with" not in str(nccl) and "transport='gloo' and CUDA_LAUNCH_BLOCKING=1" in str(nccl)
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")  # already synchronous: the instruction named is the one
    assert cuda_hint(RuntimeError("CUDA error: device-side assert triggered")) == ""


def test_each_actor_finds_its_own_gpu_where_ray_leaves_every_gpu_visible():
    """``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: every actor sees every GPU, and device 0
    would be every actor's; the actor takes the GPU Ray assigned it (``ray.get_gpu_ids()``)."""
    noset = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}
    assert cuda_index({}, gpu_ids=["3"]) is None  # Ray set CUDA_VISIBLE_DEVICES to the actor's GPU: device 0
    assert cuda_index(noset, gpu_ids=["3"]) == 3
    assert cuda_index({**noset, "CUDA_VISIBLE_DEVICES": "2,3,5"}, gpu_ids=["5"]) == 2
    assert cuda_index(noset, gpu_ids=[]) is None
    with pytest.raises(RuntimeError, match=r"Ray assigned GPU 4 .*hides"):
        cuda_index({**noset, "CUDA_VISIBLE_DEVICES": "0,1"}, gpu_ids=["4"])


def test_every_ray_we_start_is_told_torchs_gpu_count():
    """Ray counts GPUs itself; a local Ray we start is given torch's count (``local_gpus``), so the
    two never disagree about what a pipeline may place."""
    root = pathlib.Path(__file__).resolve().parents[3]
    missing = []
    for path in sorted([*root.glob("mpmd/**/*.py"), root / "tests" / "conftest.py"]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "ray.init":
                names = {k.arg for k in node.keywords}
                if "address" not in names and "num_gpus" not in names:
                    missing.append(f"{path.relative_to(root)}:{node.lineno}")
    assert not missing, missing
