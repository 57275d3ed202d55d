"""Context parallelism and the overlapped forward-backward on one shared GPU (``make gpu-check
STEP=long``; skipped without CUDA). Two NCCL ranks cannot share a GPU, so the actors exchange
over gloo through host copies (the ring's K/V and dK/dV, the experts' all-to-alls); NCCL's
order is the order model's to check. Each run equals one process on the same GPU."""

from __future__ import annotations

import pytest
import torch

import mpmd
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss
from tests.models import reference_train, sgd
from tests.mpmd.moe.test_expert_parallel import _compare, _config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs CUDA: run `make gpu-check` on a machine with an NVIDIA GPU")]


@pytest.mark.parametrize("pp, schedule", [(1, "1f1b"), (2, "zbv")])
def test_cp2_on_one_shared_gpu_equals_one_process(ray_session, pp, schedule):
    num_stages = 4 if schedule == "zbv" else pp
    cfg = GPTConfig(vocab_size=32, seq_len=64, d_model=32, n_heads=4, n_layers=max(2, num_stages))
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 32, (4, 64), generator=g), torch.randint(0, 32, (4, 64), generator=g)) for _ in range(2)]
    with mpmd.Pipeline(gpt_stages(cfg, num_stages), schedule=schedule, num_microbatches=2, loss_fn=lm_loss,
                       optimizer=sgd, num_actors=pp, cp=2, device="cuda", num_gpus=0.25) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref_losses = reference_train(gpt_stages(cfg, num_stages), data, 2, lm_loss, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key].cpu(), value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_dualpipev_overlapped_on_one_shared_gpu_equals_one_process(ray_session):
    # the backward thread runs on the actor's CUDA device and stream (actors/overlap.py)
    _compare(gpt_stages(_config(), 4), "dualpipev", dp=2, ep=2, m=4, num_actors=2, overlap=True, aux=0.01,
             device="cuda", num_gpus=0.25)
