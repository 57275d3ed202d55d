"""Expert parallelism on one shared GPU (``make gpu-check``; skipped without CUDA): 4 actors on
the GPU exchange tokens by gloo through pinned host memory (two NCCL ranks cannot share a GPU;
NCCL's all-to-all order is the order model's to check), equal to one process on the same GPU."""

from __future__ import annotations

import pytest
import torch

import schedules
from mpmd.models.gpt import gpt_stages
from tests.mpmd.moe.test_expert_parallel import _compare, _config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: run `make gpu-check` on a machine with an NVIDIA GPU")]


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_ep2_on_one_shared_gpu_equals_one_process(ray_session, schedule):
    per = schedules.schedule_info(schedule).default_stages_per_rank
    _compare(gpt_stages(_config(score_func="sigmoid"), 2 * per), schedule, dp=2, ep=2, num_actors=2, aux=0.01,
             rate=0.01, zero=1, device="cuda", num_gpus=0.25)
