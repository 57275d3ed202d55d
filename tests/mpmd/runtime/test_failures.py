"""A dead actor: fit restarts from the last checkpoint (max_restarts), or raises
ActorDiedError within seconds (the README says 0.1-0.2 s after ray.kill; the bound here
leaves room for a loaded machine but stays far under ``comm_timeout_s``, so detection by
a peer's timeout would fail it) and leaves none of the pipeline's actors alive."""

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

from tests.models import adamw, make_data, make_stages, reference_train, sgd

DATA = make_data(6, 8)
COMM_TIMEOUT_S = 30.0
DETECTION_BOUND_S = 5.0


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def wait_until_dead(handle, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(handle.pid.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError(f"the actor still answers {timeout_s:.0f}s after ray.kill")


def running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] not in "ZX"  # a zombie waiting to be reaped is gone
    except OSError:
        return False


def wait_processes_gone(pids: list[int], timeout_s: float = 60.0) -> list[int]:
    """Poll until none of ``pids`` runs; returns those still running at ``timeout_s``."""
    deadline, tick = time.monotonic() + timeout_s, threading.Event()
    while (alive := [p for p in pids if running(p)]) and time.monotonic() < deadline:
        tick.wait(0.05)
    return alive


@pytest.fixture(scope="module")
def pipe(ray_session):
    """2 stages on 2 actors, with dropout: a restart must restore the actors' RNG states too."""
    stages = make_stages(2)
    stages[0] = nn.Sequential(stages[0], nn.Dropout(0.25))
    p = mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=adamw,
                      device="cpu", comm_timeout_s=COMM_TIMEOUT_S)
    yield p
    p.shutdown()


def test_max_restarts_resumes_from_the_last_checkpoint_exactly(pipe, tmp_path):
    start = pipe.save(tmp_path / "start")
    expected_history = pipe.fit(DATA, progress=False)
    expected = pipe.state_dict()
    pipe.load(start)
    first_actors = list(pipe.actors)

    def kills_rank_1_before_step_3():
        for i, batch in enumerate(DATA):
            if i == 3:
                ray.kill(first_actors[1])
                wait_until_dead(first_actors[1])
            yield batch

    with pytest.warns(UserWarning, match=r"restarting the pipeline's actors \(1 of max_restarts=1\) from "
                                         r".*step-00000002 after: the actor of rank 1"):
        history = pipe.fit(kills_rank_1_before_step_3(), checkpoint_dir=tmp_path / "run", checkpoint_every=2,
                           max_restarts=1, progress=False)
    assert len(pipe.actors) == 2 and not set(pipe.actors) & set(first_actors)
    assert history == expected_history
    assert equal_states(pipe.state_dict(), expected)


def test_max_restarts_with_two_replicas_equals_single_process_training(ray_session, tmp_path):
    """A restart of a dp=2 pipeline (four actors, one killed) goes on from the checkpoint to
    the parameters single-process training reaches (SGD: a replica average off by a factor,
    or a replayed batch counted twice, would show)."""
    stages = make_stages(2)
    model, ref_losses = reference_train(stages, DATA, 4, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, dp=2, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu") as dp_pipe:
        first = list(dp_pipe.actors)

        def kills_replica_1_rank_0_before_step_3():
            for i, batch in enumerate(DATA):
                if i == 3:
                    ray.kill(first[2])
                    wait_until_dead(first[2])
                yield batch

        with pytest.warns(UserWarning, match=r"restarting the pipeline's actors \(1 of max_restarts=1\)"):
            history = dp_pipe.fit(kills_replica_1_rank_0_before_step_3(), checkpoint_dir=tmp_path, checkpoint_every=2,
                                  max_restarts=1, progress=False)
        assert len(dp_pipe.actors) == 4 and not set(dp_pipe.actors) & set(first)
        state = dp_pipe.state_dict()
    torch.testing.assert_close(torch.tensor(history), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_without_restarts_a_killed_actor_raises_within_the_bound_and_nothing_is_left(pipe):
    handles = list(pipe.actors)
    pids = ray.get([a.pid.remote() for a in handles])
    running = threading.Event()
    killed_at: list[float] = []

    def batches():  # bounded: a fit that never notices the kill ends and fails the test
        for i, batch in enumerate(itertools.islice(itertools.cycle(DATA), 5000)):
            if i == 3:
                running.set()
            yield batch

    def killer():
        if running.wait(timeout=120):
            killed_at.append(time.monotonic())
            ray.kill(handles[1])

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    with pytest.raises(mpmd.ActorDiedError, match=r"the actor of rank 1 \(replica 0, stages \[1\]\) died during "
                                                  r"step \d+") as info:
        pipe.fit(batches(), progress=False)
    detected_s = time.monotonic() - killed_at[0]
    thread.join(timeout=60)
    print(f"\nfailure detection: ActorDiedError {detected_s:.2f}s after ray.kill (bound {DETECTION_BOUND_S:.0f}s)")
    assert detected_s < DETECTION_BOUND_S
    assert (info.value.rank, info.value.stages) == (1, (1,)) and info.value.step >= 3

    assert pipe.actors == []
    for handle in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.pid.remote(), timeout=60)
    assert wait_processes_gone(pids) == [], "an actor process of the pipeline is still running"
    with pytest.raises(RuntimeError, match="shut down"):
        pipe.step(*DATA[0])


def test_max_restarts_under_zero1_resumes_bit_identical(ray_session, tmp_path):
    """dp=2, zero=1, AdamW, dropout: each replica's optimizer shard and RNG state come back from
    the checkpoint; the run with a replica's actor killed equals the uninterrupted one bit for bit."""
    stages = make_stages(2)
    stages[0] = nn.Sequential(stages[0], nn.Dropout(0.25))
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, dp=2, zero=1, loss_fn=F.mse_loss,
                       optimizer=adamw, device="cpu", comm_timeout_s=COMM_TIMEOUT_S) as zpipe:
        start = zpipe.save(tmp_path / "start")
        expected_history = zpipe.fit(DATA, progress=False)
        expected = zpipe.state_dict()
        zpipe.load(start)
        first = list(zpipe.actors)

        def kills_replica_1_rank_1_before_step_3():
            for i, batch in enumerate(DATA):
                if i == 3:
                    ray.kill(first[3])
                    wait_until_dead(first[3])
                yield batch

        with pytest.warns(UserWarning, match=r"restarting the pipeline's actors \(1 of max_restarts=1\) from "
                                             r".*step-00000002"):
            history = zpipe.fit(kills_replica_1_rank_1_before_step_3(), checkpoint_dir=tmp_path / "run",
                                checkpoint_every=2, max_restarts=1, progress=False)
        assert len(zpipe.actors) == 4 and not set(zpipe.actors) & set(first)
        assert history == expected_history
        assert equal_states(zpipe.state_dict(), expected)
        held = [m["optimizer"] for m in ray.get([a.memory_bytes.remote() for a in zpipe.actors])]
        for r in range(2):  # still sharded: a rank's replicas (actors r and 2 + r) each hold a part
            assert 0 < max(held[r], held[2 + r]) < held[r] + held[2 + r]
