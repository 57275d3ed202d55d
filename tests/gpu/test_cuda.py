"""The CUDA path (``make gpu-check`` on a machine with a GPU; skipped without CUDA).

The GPU machines this project gets have one GPU, so these pipelines put 2-4 actors on it
(fractional ``num_gpus``) and the transport is gloo through pinned host memory (Note
[staged transport] in actors/staging.py).  Results are compared with single-process training
on the CPU, at a tolerance for CUDA's different (but fp32) kernels."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd
from mpmd.pipefill import FillJob

from tests.fill_jobs import double_on_cuda
from tests.models import Reference, make_data, make_stages, reference_train, sgd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: run `make gpu-check` on a machine with an NVIDIA GPU")]

MICROBATCHES = 4
DATA = make_data(4, 16)
SWEEP = [("gpipe", 2, 2), ("1f1b", 2, 2), ("interleaved-1f1b", 4, 2), ("zb-h1", 2, 2), ("zb-h2", 2, 2),
         ("zbv", 4, 2), ("dualpipev", 4, 2), ("1f1b", 4, 4), ("interleaved-1f1b", 8, 4)]


def cuda_pipeline(stages, schedule: str, num_actors: int, **options) -> mpmd.Pipeline:
    """Every actor (``num_actors`` x ``dp``) on the one GPU."""
    share = 1.0 / (num_actors * options.get("dp", 1))
    return mpmd.Pipeline(stages, schedule=schedule, num_actors=num_actors, num_microbatches=MICROBATCHES,
                         loss_fn=F.mse_loss, optimizer=sgd, device="cuda", num_gpus=share,
                         num_cpus=1.0, fusion="step", **options)


def assert_like_reference(losses, state, stages, data, microbatches=MICROBATCHES) -> None:
    model, ref = reference_train(stages, data, microbatches, F.mse_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-4, atol=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k].cpu(), v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("schedule, num_stages, num_actors", SWEEP)
def test_every_schedule_on_one_shared_gpu_equals_single_process_training(ray_session, schedule, num_stages,
                                                                         num_actors):
    stages = make_stages(num_stages)
    with cuda_pipeline(stages, schedule, num_actors) as pipe:
        assert pipe.engine.fleet.transport.staged  # the actors share the GPU: no NCCL between them
        losses = [pipe.step(x, y) for x, y in DATA]
        state = pipe.state_dict()
    assert_like_reference(losses, state, stages, DATA)


def test_data_parallel_on_one_gpu_equals_single_process_training(ray_session):
    stages = make_stages(2)
    with cuda_pipeline(stages, "1f1b", 2, dp=2) as pipe:  # four actors, a quarter of the GPU each
        assert len(pipe.actors) == 4 and pipe.engine.fleet.transport.staged
        losses = [pipe.step(x, y) for x, y in DATA]
        state = pipe.state_dict()
    assert_like_reference(losses, state, stages, DATA, microbatches=2 * MICROBATCHES)


class DtypeProbe(nn.Module):
    """Counts the forwards whose input arrived in bfloat16 (a buffer: read back via state_dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bf16_inputs", torch.zeros(()))
        self.register_buffer("inputs", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.inputs += 1
            self.bf16_inputs += float(x.dtype == torch.bfloat16)
        return x


def test_bf16_on_cuda_trains_close_to_fp32_and_carries_bf16_between_stages(ray_session):
    stages = [nn.Sequential(DtypeProbe(), s) for s in make_stages(4)]
    runs, states = {}, {}
    for precision in ("fp32", "bf16"):
        with cuda_pipeline(stages, "interleaved-1f1b", 2, precision=precision) as pipe:
            runs[precision] = [pipe.step(x, y) for x, y in DATA]
            states[precision] = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(runs["bf16"]), torch.tensor(runs["fp32"]), rtol=5e-2, atol=5e-3)
    forwards = len(DATA) * MICROBATCHES
    for s in range(4):
        seen, bf16 = states["bf16"][f"{s}.0.inputs"].item(), states["bf16"][f"{s}.0.bf16_inputs"].item()
        assert seen == forwards
        # Stage 0 gets the fp32 inputs; every later stage its predecessor's output, carried in bf16
        # (Note [precision boundary]): half the bytes on the wire.  fp32 carries fp32 everywhere.
        assert bf16 == (0 if s == 0 else forwards), (s, bf16)
        assert states["fp32"][f"{s}.0.bf16_inputs"].item() == 0


def test_fill_jobs_compute_on_the_gpu_and_leave_training_with_dropout_unchanged(ray_session):
    """The fill job runs on the actor's GPU and draws from its RNG while the main model uses
    dropout there: training equals the same pipeline without fill work, bit for bit."""
    torch.manual_seed(0)
    stages = [nn.Sequential(s, nn.Dropout(0.2)) for s in make_stages(2, d=32)]
    data = make_data(12, 16)
    inputs = [torch.randn(6) for _ in range(32)]
    runs = {}
    for fill in (False, True):
        with cuda_pipeline(stages, "1f1b", 2) as pipe:
            job = pipe.add_fill_job(FillJob(fn=double_on_cuda, data=inputs, name="double", cost_per_sample=1e-6),
                                    min_bubble_s=1e-6) if fill else None
            runs[fill] = ([pipe.step(x, y) for x, y in data], pipe.state_dict())
    assert runs[True][0] == runs[False][0]
    assert all(torch.equal(v, runs[False][1][k]) for k, v in runs[True][1].items())
    assert job.done()
    outputs, on_cuda = zip(*job.results())
    torch.testing.assert_close(torch.stack([o.cpu() for o in outputs]), torch.stack(inputs) * 2)
    assert all(flag.item() == 1.0 for flag in on_cuda)  # computed on the GPU, not the CPU


def test_nccl_order_on_cuda_trains_like_one_process(ray_session):
    """The actors' NCCL posting order (Note [NCCL order]) run on the GPU through per-pair queues:
    the order NCCL itself would see between two GPUs, on the one GPU here."""
    stages = make_stages(4)
    with cuda_pipeline(stages, "interleaved-1f1b", 2, transport="nccl-order") as pipe:
        assert pipe.engine.fleet.transport.queued
        losses = [pipe.step(x, y) for x, y in DATA]
        state = pipe.state_dict()
    assert_like_reference(losses, state, stages, DATA)


def sum_of_means(losses, num_microbatches: int) -> float:
    return sum(loss.item() / num_microbatches for loss in losses)


def test_clipping_and_recompute_on_cuda_equal_single_process(ray_session):
    """The agreed update's fused kernels on CUDA (actors/update.py: foreach norm and scale) and
    recompute: the clipped run equals plain PyTorch's ``clip_grad_norm_`` in one process."""
    stages, clip = make_stages(3), 0.05
    with cuda_pipeline(stages, "1f1b", 3, clip_grad_norm=clip, recompute=True) as pipe:
        results = [pipe.step_async(x, y).wait() for x, y in DATA]
        state = pipe.state_dict()
    reference = Reference(stages, MICROBATCHES, F.mse_loss, sgd, clip=clip, step_loss=sum_of_means)
    for (x, y), r in zip(DATA, results, strict=True):
        loss, norm, _ = reference.step(x, y)
        assert norm > clip, "the case meant to clip did not"
        assert r.loss == pytest.approx(loss, rel=1e-4) and r.grad_norm == pytest.approx(norm, rel=1e-4)
    for k, v in reference.model.state_dict().items():
        torch.testing.assert_close(state[k].cpu(), v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")


def test_a_killed_gpu_actor_raises_within_the_comm_timeout(ray_session):
    with cuda_pipeline(make_stages(2), "1f1b", 2, comm_timeout_s=30) as pipe:
        handles, running, killed_at = list(pipe.actors), threading.Event(), []

        def batches():
            for i, batch in enumerate(itertools.islice(itertools.cycle(DATA), 5000)):
                if i == 3:
                    running.set()
                yield batch

        def killer():
            if running.wait(timeout=120):
                killed_at.append(time.monotonic())
                ray.kill(handles[1])

        threading.Thread(target=killer, daemon=True).start()
        with pytest.raises(mpmd.ActorDiedError):
            pipe.fit(batches(), progress=False)
        assert time.monotonic() - killed_at[0] < 30


def test_checkpoints_from_gpu_actors_resume_exactly(ray_session, tmp_path):
    stages = make_stages(4)
    with cuda_pipeline(stages, "interleaved-1f1b", 2) as pipe:
        for x, y in DATA[:2]:
            pipe.step(x, y)
        pipe.save(tmp_path / "ck")
        later = [pipe.step(x, y) for x, y in DATA[2:]]
        whole = pipe.state_dict()
    with mpmd.Pipeline.load(tmp_path / "ck", stages=make_stages(4, seed=3), loss_fn=F.mse_loss, optimizer=sgd,
                            num_gpus=0.5) as resumed:
        assert [resumed.step(x, y) for x, y in DATA[2:]] == later
        assert all(torch.equal(v, whole[k]) for k, v in resumed.state_dict().items())


class Matmuls(nn.Module):
    """GPU-bound: ``reps`` chained matmuls, milliseconds of kernels behind microseconds of launches."""

    def __init__(self, d: int = 2048, reps: int = 48) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(d, d) / d**0.5)
        self.reps = reps

    def forward(self, x):
        for _ in range(self.reps):
            x = torch.tanh(x @ self.w)
        return x


def test_profiled_forward_time_is_the_kernels_time_not_the_launches(ray_session):
    """Note [device timing]: the profile's forward cost of a GPU-bound stage against CUDA events
    around the same forward in this process (ground truth).  Timed by the host clock around the
    launches, the profile would report a small fraction of it."""
    torch.manual_seed(0)
    heavy, rows = Matmuls(), 512
    x = torch.randn(rows, 2048, device="cuda")
    probe = Matmuls().cuda()
    with torch.no_grad():
        for _ in range(3):
            probe(x)  # warm-up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            probe(x)
        end.record()
        torch.cuda.synchronize()
    truth_s = start.elapsed_time(end) / 5 / 1e3
    del probe, x
    stages = [heavy, nn.Linear(2048, 3)]
    data = [(torch.randn(MICROBATCHES * rows, 2048), torch.randn(MICROBATCHES * rows, 3))]
    with cuda_pipeline(stages, "1f1b", 2) as pipe:
        report = pipe.profile(*data[0], steps=3)
    measured = report.costs.values("f")[0]
    print(f"\nforward of stage 0: profile {measured * 1e3:.2f} ms, CUDA events {truth_s * 1e3:.2f} ms")
    # Two actors share the GPU, so the stage may run slower than alone, never much faster.
    assert measured >= 0.6 * truth_s, (measured, truth_s)
    assert measured <= 4.0 * truth_s + 5e-3, (measured, truth_s)


def test_the_profile_reports_each_actors_peak_gpu_memory(ray_session):
    with cuda_pipeline(make_stages(4, d=256), "interleaved-1f1b", 2) as pipe:
        report = pipe.profile(*DATA[0])
    assert len(report.device_peak_memory_bytes) == 2 and all(b > 0 for b in report.device_peak_memory_bytes)
    print(f"\npeak GPU memory per actor: {[f'{b / 2**20:.1f} MiB' for b in report.device_peak_memory_bytes]}")


SPLIT_CHECK = """
import datetime, os, torch, torch.distributed as dist
from actors.group_plan import GroupKind, GroupPlan, GroupSpec
from actors.groups import formation_for
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + os.environ["PORT"], world_size=1, rank=0,
                        device_id=torch.device("cuda:0"), timeout=datetime.timedelta(seconds=60))
# one GPU holds one NCCL rank: the plan's groups are one-rank groups (GroupPlan.of leaves those out)
plan = GroupPlan((GroupSpec(GroupKind.DP, 0, (0,)), GroupSpec(GroupKind.PAIR, 0, (0,))))
formed = formation_for("nccl").form(plan, 0, backend="nccl",
                                    timeouts={GroupKind.PAIR: datetime.timedelta(seconds=90)})
assert formed.calls == len(plan.split_rounds) == 2, formed.calls
x = torch.ones(4, device="cuda")
dist.all_reduce(x, group=formed.dp)
assert x.tolist() == [1.0] * 4, x
dist.destroy_process_group()
print("split ok", formed.calls)
"""


def test_nccl_split_rounds_form_groups_on_the_gpu():
    """Note [group formation]: NCCL's groups come from ``split_group`` of the eagerly made world
    communicator.  One GPU holds one NCCL rank, so this forms one-rank groups: the calls, the
    device binding and a collective on a split group, not a split across GPUs."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PORT=str(port), PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", SPLIT_CHECK], env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "split ok 2" in done.stdout
