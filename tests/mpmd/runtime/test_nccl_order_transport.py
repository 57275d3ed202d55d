"""The actors' real posting order run under NCCL's order on the CPU (``transport="nccl-order"``,
Note [NCCL order on the CPU] in actors/pair_queues.py): each pair's operations in posted order
on one queue, each blocking it until matched.  Training equals single-process training (where
today's prefetch hung from the second step on), and the engine refuses a program NCCL could
hang on before any step runs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import mpmd
import schedules
from mpmd.pipefill import FillJob
from mpmd.runtime.compile import compile_programs
from mpmd.runtime.transport import check_before_launch
from schedules import Action, DeadlockError, Kind

from tests.fill_jobs import scale_and_shift
from tests.models import make_data, make_stages, reference_train, sgd
from tests.mpmd.runtime.test_ties import lm_loss, tied_lm, token_data

MICROBATCHES = 4


def _assert_trains_like_one_process(stages, data, losses, state, microbatches, loss_fn=F.mse_loss):
    model, ref = reference_train(stages, data, microbatches, loss_fn, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref), rtol=1e-5, atol=1e-7)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7, msg=lambda m: f"{k}: {m}")


@pytest.mark.parametrize("schedule, num_stages, dp", [
    ("1f1b", 2, 2),               # the case today's prefetch hangs on, with the dp all-reduce
    ("gpipe", 2, 1),
    ("interleaved-1f1b", 4, 1),   # two stages per actor, both directions to one peer
    ("zbv", 4, 1),
    ("dualpipev", 4, 1),
])
def test_the_nccl_order_transport_trains_like_one_process(ray_session, schedule, num_stages, dp):
    stages, data = make_stages(num_stages), make_data(4, 16)
    with mpmd.Pipeline(stages, schedule=schedule, num_actors=2, dp=dp, num_microbatches=MICROBATCHES,
                       loss_fn=F.mse_loss, optimizer=sgd, device="cpu", transport="nccl-order",
                       comm_timeout_s=20.0) as pipe:
        assert pipe.engine.fleet.transport.queued and pipe.engine.fleet.transport.ordered
        losses = [pipe.step(x, y) for x, y in data]  # steps 2.. post receives ahead
        state = pipe.state_dict()
    _assert_trains_like_one_process(stages, data, losses, state, MICROBATCHES * dp)


def test_interleaved_on_three_actors_under_nccl_order(ray_session):
    """Three actors: each message travels on its pair's group (Note [point-to-point groups] in
    actors/comm.py).  With every message on the world group, one queue per actor as eager
    initialisation runs them, this hangs from the second step (tests/actors/test_pair_queues.py)."""
    stages, data = make_stages(6), make_data(3, 12)
    with mpmd.Pipeline(stages, schedule="interleaved-1f1b", num_actors=3, num_microbatches=3, loss_fn=F.mse_loss,
                       optimizer=sgd, device="cpu", transport="nccl-order", comm_timeout_s=20.0) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    _assert_trains_like_one_process(stages, data, losses, state, 3)


def test_zero1_under_nccl_order(ray_session):
    """ZeRO-1's reduce-scatter and owner broadcasts on the DP groups, between NCCL-ordered
    point-to-point traffic: trains like one process."""
    stages, data = make_stages(2), make_data(3, 16)
    with mpmd.Pipeline(stages, schedule="1f1b", num_actors=2, dp=2, zero=1, num_microbatches=MICROBATCHES,
                       loss_fn=F.mse_loss, optimizer=sgd, device="cpu", transport="nccl-order",
                       comm_timeout_s=20.0) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    _assert_trains_like_one_process(stages, data, losses, state, MICROBATCHES * 2)


def test_tied_parameters_and_fill_slots_under_nccl_order(ray_session):
    data, stages = token_data(3, 8), tied_lm(2)
    with mpmd.Pipeline(stages, schedule="1f1b", num_actors=2, num_microbatches=MICROBATCHES, loss_fn=lm_loss,
                       optimizer=sgd, device="cpu", transport="nccl-order", comm_timeout_s=20.0) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    _assert_trains_like_one_process(stages, data, losses, state, MICROBATCHES, lm_loss)

    stages, data = make_stages(2), make_data(10, 16)
    inputs = [torch.randn(6) for _ in range(24)]
    with mpmd.Pipeline(stages, schedule="1f1b", num_actors=2, dp=2, num_microbatches=MICROBATCHES,
                       loss_fn=F.mse_loss, optimizer=sgd, device="cpu", transport="nccl-order",
                       comm_timeout_s=20.0) as pipe:
        job = pipe.add_fill_job(FillJob(fn=scale_and_shift, data=inputs, max_chunk=4, cost_per_sample=1e-6),
                                min_bubble_s=1e-6)
        losses = []
        for x, y in data:
            losses.append(pipe.step(x, y))
            if job.done():
                break
        assert job.done() and any(a.kind is Kind.FILL for a in pipe.engine.lower_train().ranks[0]) is False
        assert any(ins.kind is Kind.FILL for ins in pipe.engine.program("train")[0])  # slots were shipped
        state = pipe.state_dict()
    _assert_trains_like_one_process(stages, data[:len(losses)], losses, state, MICROBATCHES * 2)


def test_fed_steps_under_nccl_order(ray_session):
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False
    data = make_data(3, 8)
    rows = [{"x": x.numpy(), "y": y.numpy()} for inputs, targets in data for x, y in zip(inputs, targets)]
    stages = make_stages(2)
    with mpmd.Pipeline(stages, schedule="1f1b", num_actors=2, num_microbatches=2, loss_fn=F.mse_loss,
                       optimizer=sgd, device="cpu", transport="nccl-order", comm_timeout_s=20.0) as pipe:
        fed = pipe.fit(ray.data.from_items(rows), batch_size=8, columns=("x", "y"), epochs=1, progress=False)
        assert pipe.engine.last_dispatch.bare == 2  # the targets went actor to actor, first in the step
        state = pipe.state_dict()
    model, ref = reference_train(stages, data, 2, F.mse_loss, optimizer=sgd)
    assert np.allclose(list(fed), ref, rtol=1e-5, atol=1e-6)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7)


# Rank 1 sends B0 before it receives F1, rank 0 sends F1 before it receives B0: on gloo each
# send goes out on its own; on NCCL both sends head the pair's streams and wait for each other.
CROSSED = schedules.Schedule(ranks=(
    tuple(map(Action.parse, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0FREE0 0RECV_B1 0B1 0FREE1".split())),
    tuple(map(Action.parse, "1RECV_F0 1F0 1B0 1SEND_B0 1FREE0 1RECV_F1 1F1 1B1 1SEND_B1 1FREE1".split())),
), num_microbatches=2, stage_to_rank=(0, 1))


def test_before_any_actor_starts_the_programs_are_checked_where_nccl_order_will_hold():
    programs = {"train": compile_programs(CROSSED)}
    for requested, device, gpus in (("nccl", "cuda", 1.0), ("nccl-order", "cpu", 0.0), ("auto", "cuda", 1.0)):
        with pytest.raises(DeadlockError, match=r"the 'train' program could hang on NCCL"):
            check_before_launch(requested, device, gpus, programs, CROSSED, 1)
    for requested, device, gpus in (("auto", "cuda", 0.5), ("auto", "cpu", 0.0), ("gloo", "cuda", 1.0)):
        check_before_launch(requested, device, gpus, programs, CROSSED, 1)  # gloo: tags pair the messages


def test_a_program_nccl_could_hang_on_is_refused_before_it_runs(ray_session):
    stages, data, crossed = make_stages(2), make_data(2, 8), CROSSED
    for transport in ("gloo", "nccl-order"):
        with mpmd.Pipeline(stages, schedule="1f1b", num_actors=2, num_microbatches=2, loss_fn=F.mse_loss,
                           optimizer=sgd, device="cpu", transport=transport, comm_timeout_s=20.0) as pipe:
            if transport == "gloo":
                pipe.engine.install_program("train", crossed)
                pipe.step(*data[0])  # gloo pairs by tag: it runs
                continue
            before = pipe.engine.program("train")
            stuck = (r"(?s)the 'train' program could hang on NCCL, so it is not installed.*in the first step.*"
                     r"rank 0: stuck at 0RECV_B0 \(waiting for data\); its streams start with 0SEND_F1's shape "
                     r"header \(send\)")
            with pytest.raises(DeadlockError, match=stuck):
                pipe.engine.install_program("train", crossed)
            assert pipe.engine.program("train") == before
            pipe.step(*data[0])  # the pipeline goes on with its own program
