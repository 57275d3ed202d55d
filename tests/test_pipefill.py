"""PipeFill: planning (pure) and fill jobs inside a training pipeline's bubbles."""

from __future__ import annotations

import pytest
import torch

import mpmd
from mpmd.pipefill import POLICIES, Bubble, FillJob, plan_fill

from fill_jobs import explode_on_negative, infer
from models import adamw, make_data, make_stages, reference_train

mse = torch.nn.functional.mse_loss


def _job(n: int, cost=None, mem=None, name="j") -> FillJob:
    job = FillJob(fn=lambda b: b, data=list(range(n)), name=name, cost_per_sample=cost, memory_per_sample=mem,
                  collate=False)
    return job


def _ids(*jobs):
    for i, j in enumerate(jobs):
        j.id = i
    return list(jobs)


def test_chunks_fit_the_bubble_time_and_memory():
    (job,) = _ids(_job(100, cost=0.001, mem=10))
    bubbles = [Bubble(0, 3, seconds=0.010, free_bytes=10**9), Bubble(1, 5, seconds=0.010, free_bytes=40)]
    plan = plan_fill(bubbles, {(0, 3): 0, (1, 5): 0}, [job], POLICIES["fifo"], margin=0.2)
    (c0,) = plan[0][0]
    (c1,) = plan[1][0]
    assert (c0[1], c0[2], c0[3]) == (0, 8, list(range(8)))  # 8 ms of a 10 ms bubble with a 20% margin
    assert (c1[1], c1[2]) == (8, 4)  # memory allows 4 samples of 10 bytes
    assert job.next == 12


def test_unmeasured_job_gets_one_probe_sample_per_step():
    (job,) = _ids(_job(10))
    bubbles = [Bubble(0, 1, 0.01, 10**9), Bubble(1, 1, 0.01, 10**9)]
    plan = plan_fill(bubbles, {(0, 1): 0, (1, 1): 0}, [job], POLICIES["fifo"], margin=0.1)
    chunks = [c for r in plan.values() for cs in r.values() for c in cs]
    assert [c[2] for c in chunks] == [1]


def test_policies_order_jobs():
    big, small = _ids(_job(100, cost=0.001, name="big"), _job(5, cost=0.002, name="small"))
    assert [j.name for j in POLICIES["fifo"]([small, big])] == ["big", "small"]
    assert [j.name for j in POLICIES["sjf"]([big, small])] == ["small", "big"]
    assert [j.name for j in POLICIES["throughput"]([small, big])] == ["big", "small"]


def test_every_input_is_handed_out_once_in_order():
    a, b = _ids(_job(7, cost=0.001, name="a"), _job(5, cost=0.001, name="b"))
    bubbles = [Bubble(r, 2, 0.003, 10**9) for r in range(2)]
    slots = {(r, 2): 0 for r in range(2)}
    handed = {0: [], 1: []}
    for _ in range(6):
        for r in plan_fill(bubbles, slots, [a, b], POLICIES["fifo"], margin=0.0).values():
            for chunks in r.values():
                for job_id, start, n, samples in chunks:
                    assert len(samples) == n
                    handed[job_id] += samples
    assert handed == {0: list(range(7)), 1: list(range(5))}


def test_fill_job_validation():
    with pytest.raises(ValueError, match="no inputs"):
        FillJob(fn=infer, data=[])
    with pytest.raises(ValueError, match="callable"):
        FillJob(fn=3, data=[1])


def _pipeline(stages):
    return mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=4, loss_fn=mse, optimizer=adamw, device="cpu")


def test_fill_jobs_process_every_input_once_and_leave_training_unchanged(ray_session):
    stages = make_stages(2, d=32)
    data = make_data(8, 16)
    ref, ref_losses = reference_train(stages, data, 4, mse)
    inputs = [torch.randn(6) for _ in range(64)]
    with _pipeline(stages) as pipe:
        first = pipe.add_fill_job(FillJob(fn=infer, data=inputs, name="infer", cost_per_sample=1e-6),
                                  min_bubble_s=1e-6)
        second = pipe.add_fill_job(FillJob(fn=infer, data=inputs[:9], name="small"))
        losses = [pipe.step(x, y) for x, y in data]
        summary = pipe._fill.summary()
        state = pipe.state_dict()
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7)
    expected = infer(torch.stack(inputs))
    assert first.done() and second.done(), summary
    torch.testing.assert_close(torch.stack(first.results()), expected)
    torch.testing.assert_close(torch.stack(second.results()), expected[:9])


def test_a_failing_fill_job_is_marked_failed_and_training_goes_on(ray_session):
    stages = make_stages(2, d=32)
    data = make_data(4, 16)
    ref, ref_losses = reference_train(stages, data, 4, mse)
    bad_inputs = [torch.randn(6) for _ in range(6)] + [torch.full((6,), -1000.0)] + [torch.randn(6) for _ in range(6)]
    with _pipeline(stages) as pipe:
        bad = pipe.add_fill_job(FillJob(fn=explode_on_negative, data=bad_inputs, name="bad", cost_per_sample=1e-6),
                                min_bubble_s=1e-6)
        losses = [pipe.step(x, y) for x, y in data]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert bad.failed() and bad.done()
    assert "fill boom" in bad.error
    with pytest.raises(RuntimeError, match="fill boom"):
        bad.results()


def test_unknown_policy_is_refused(ray_session):
    with _pipeline(make_stages(2)) as pipe:
        with pytest.raises(ValueError, match="unknown fill policy"):
            pipe.add_fill_job(FillJob(fn=infer, data=[torch.randn(6)]), policy="random")
