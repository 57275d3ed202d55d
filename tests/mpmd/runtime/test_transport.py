"""The transport between actors (mpmd/runtime/transport.py): which one is chosen where, and
the shared-GPU path (gloo through host memory, Note [staged transport] in actors/staging.py)
run on the CPU with ``transport="staged"``: every send, receive and all-reduce goes through
a staged copy, and training still equals single-process training and the unstaged run."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import mpmd
from mpmd.runtime.transport import choose_transport

from tests.models import make_data, make_stages, reference_train, sgd
from tests.mpmd.runtime.test_ties import lm_loss, tied_lm, token_data

MICROBATCHES = 4
DATA = make_data(3, 16)


def test_actors_sharing_a_gpu_go_through_host_memory():
    shared = [("node-a", ("0",)), ("node-a", ("0",)), ("node-a", ("1",))]
    chosen = choose_transport("auto", "cuda", shared)
    assert (chosen.backend, chosen.staged) == ("gloo", True)
    assert "actors 0, 1 share GPU 0" in chosen.reason and "NCCL cannot join two ranks on one GPU" in chosen.reason
    own = [("node-a", ("0",)), ("node-a", ("1",)), ("node-b", ("0",))]
    assert choose_transport("auto", "cuda", own)[:2] == ("nccl", False)
    assert choose_transport("gloo", "cuda", own)[:2] == ("gloo", True)
    assert choose_transport("auto", "cpu", [])[:2] == ("gloo", False)
    assert choose_transport("staged", "cpu", [])[:2] == ("gloo", True)
    with pytest.raises(ValueError, match=r"transport='nccl' cannot join two actors on one GPU \(actors 0, 1 share"):
        choose_transport("nccl", "cuda", shared)
    with pytest.raises(ValueError, match=r"transport='nccl' needs device='cuda'"):
        choose_transport("nccl", "cpu", [])
    with pytest.raises(ValueError, match=r"transport must be 'auto', 'nccl', 'gloo', 'staged' or 'nccl-order', got 'tcp'"):
        mpmd.Pipeline(make_stages(2), num_actors=2, loss_fn=F.mse_loss, device="cpu", transport="tcp")


@pytest.mark.parametrize("schedule, num_stages, dp", [
    ("1f1b", 2, 2),               # sends, receives and the dp all-reduce
    ("interleaved-1f1b", 4, 1),   # receives prefetched (irecv) through staging
    ("zbv", 4, 1),
    ("dualpipev", 4, 1),
])
def test_the_staged_transport_trains_like_one_process(ray_session, schedule, num_stages, dp):
    stages = make_stages(num_stages)
    options = dict(schedule=schedule, num_actors=2, dp=dp, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                   optimizer=sgd, device="cpu", bucket_bytes=64)
    with mpmd.Pipeline(stages, transport="staged", **options) as pipe:
        assert pipe.engine.fleet.transport.staged
        staged = [pipe.step(x, y) for x, y in DATA]
        staged_state = pipe.state_dict()
    with mpmd.Pipeline(stages, **options) as pipe:
        assert not pipe.engine.fleet.transport.staged
        plain = [pipe.step(x, y) for x, y in DATA]
        assert all(torch.equal(staged_state[k], v) for k, v in pipe.state_dict().items())
    assert staged == plain
    model, losses = reference_train(stages, DATA, MICROBATCHES * dp, F.mse_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(staged), torch.tensor(losses), rtol=1e-5, atol=1e-7)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(staged_state[k], v, rtol=1e-5, atol=1e-7)


def test_tied_parameters_reduce_through_staging(ray_session):
    data, stages = token_data(3, 8), tied_lm(2)
    with mpmd.Pipeline(stages, schedule="1f1b", num_actors=2, num_microbatches=MICROBATCHES, loss_fn=lm_loss,
                       optimizer=sgd, device="cpu", transport="staged") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref = reference_train(stages, data, MICROBATCHES, lm_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-7)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7)
