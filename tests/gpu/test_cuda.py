"""The CUDA path (``make gpu-check`` on a machine with a GPU; skipped without CUDA).

The GPU machines this project gets have one GPU, so these pipelines put 2-4 actors on it
(fractional ``num_gpus``) and the transport is gloo through pinned host memory (Note
[staged transport] in actors/comm.py).  Results are compared with single-process training
on the CPU, at a tolerance for CUDA's different (but fp32) kernels."""

from __future__ import annotations

import itertools
import threading
import time

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd
from mpmd.pipefill import FillJob

from tests.fill_jobs import infer
from tests.models import make_data, make_stages, reference_train, sgd

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: run `make gpu-check` on a machine with an NVIDIA GPU")]

MICROBATCHES = 4
DATA = make_data(4, 16)
SWEEP = [("gpipe", 2, 2), ("1f1b", 2, 2), ("interleaved-1f1b", 4, 2), ("zb-h1", 2, 2), ("zbv", 4, 2),
         ("dualpipev", 4, 2), ("1f1b", 4, 4), ("interleaved-1f1b", 8, 4)]


def cuda_pipeline(stages, schedule: str, num_actors: int, **options) -> mpmd.Pipeline:
    return mpmd.Pipeline(stages, schedule=schedule, num_actors=num_actors, num_microbatches=MICROBATCHES,
                         loss_fn=F.mse_loss, optimizer=sgd, device="cuda", num_gpus=1.0 / num_actors,
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
        assert pipe.engine.transport.staged  # the actors share the GPU: no NCCL between them
        losses = [pipe.step(x, y) for x, y in DATA]
        state = pipe.state_dict()
    assert_like_reference(losses, state, stages, DATA)


def test_data_parallel_on_one_gpu_equals_single_process_training(ray_session):
    stages = make_stages(2)
    with cuda_pipeline(stages, "1f1b", 2, dp=2) as pipe:
        losses = [pipe.step(x, y) for x, y in DATA]
        state = pipe.state_dict()
    assert_like_reference(losses, state, stages, DATA, microbatches=2 * MICROBATCHES)


def test_bf16_on_cuda_trains_close_to_fp32(ray_session):
    stages = make_stages(4)
    runs = {}
    for precision in ("fp32", "bf16"):
        with cuda_pipeline(stages, "interleaved-1f1b", 2, precision=precision) as pipe:
            runs[precision] = [pipe.step(x, y) for x, y in DATA]
    torch.testing.assert_close(torch.tensor(runs["bf16"]), torch.tensor(runs["fp32"]), rtol=5e-2, atol=5e-3)


def test_fill_jobs_on_cuda_leave_training_unchanged(ray_session):
    stages = make_stages(2, d=32)
    data = make_data(12, 16)
    inputs = [torch.randn(6) for _ in range(32)]
    with cuda_pipeline(stages, "1f1b", 2) as pipe:
        job = pipe.add_fill_job(FillJob(fn=infer, data=inputs, name="infer", cost_per_sample=1e-6),
                                min_bubble_s=1e-6)
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    assert_like_reference(losses, state, stages, data)
    assert job.done()
    torch.testing.assert_close(torch.stack([r.cpu() for r in job.results()]), infer(torch.stack(inputs)))


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


def test_the_profile_reports_each_actors_peak_gpu_memory(ray_session):
    with cuda_pipeline(make_stages(4, d=256), "interleaved-1f1b", 2) as pipe:
        report = pipe.profile(*DATA[0])
    assert len(report.device_peak_memory_bytes) == 2 and all(b > 0 for b in report.device_peak_memory_bytes)
    print(f"\npeak GPU memory per actor: {[f'{b / 2**20:.1f} MiB' for b in report.device_peak_memory_bytes]}")
