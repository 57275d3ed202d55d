"""Sharded and asynchronous checkpoints (Note [sharded checkpoint], Note [asynchronous save]):
each actor writes its own files; ``save(blocking=False)`` returns once the actors hold a copy
and training goes on while they write; a failed write surfaces at the next step; fit's
asynchronous checkpoints resume and restart from the last *complete* one.  Outcomes are
compared with uninterrupted runs (bit for bit) and single-process training."""

from __future__ import annotations

import os
import threading

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd
from mpmd.training import CheckpointError, PendingSave, checkpoint

from tests.models import make_data, make_stages, reference_train, sgd
from tests.mpmd.training.ckpt_faults import HELD, UNWRITABLE, FaultyStage, hold, release

MICROBATCHES = 2
DATA = make_data(6, 8)


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def faulty_pipeline(flag, fault: str, **options) -> mpmd.Pipeline:
    """4 stages, interleaved 1F1B on 2 actors; stage 2 (on actor 0) has the fault while ``flag`` exists."""
    stages = make_stages(4)
    stages[2] = FaultyStage(flag, fault, *stages[2])
    return mpmd.Pipeline(stages, schedule="interleaved-1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                         optimizer=sgd, device="cpu", step_timeout_s=120, **options)


def test_an_async_save_copies_the_state_and_writes_while_steps_go_on(ray_session, tmp_path):
    flag = tmp_path / "hold"
    with faulty_pipeline(flag, HELD) as pipe:
        pipe.fit(DATA[:2], progress=False)
        at_save = pipe.state_dict()
        hold(flag)  # actor 0's write of stage 2 now waits for us
        pending = pipe.save(tmp_path / "ck", blocking=False)
        os.unlink(flag)  # the copy is taken: what comes next is not held
        assert isinstance(pending, PendingSave) and pending.path == str(tmp_path / "ck")
        losses = [pipe.step(*batch) for batch in DATA[2:4]]  # the writer holds no lock
        assert not pending.done() and not os.path.exists(pending.path)  # visible only when complete
        release(flag).join(timeout=60)
        assert pending.result(timeout=60) == str(tmp_path / "ck")
        after = pipe.state_dict()

        # A second save waits for the first: one save in flight.
        hold(flag)
        first = pipe.save(tmp_path / "first", blocking=False)
        os.unlink(flag)
        releasing = release(flag)
        second = pipe.save(tmp_path / "second", blocking=False)
        assert first.done()
        assert first.result() and second.result(timeout=60)
        releasing.join(timeout=60)

    names = sorted(os.listdir(tmp_path / "ck"))
    assert names == ["manifest.json", "rng-0000.pt", "rng-0001.pt",
                     "stage-0000.pt", "stage-0001.pt", "stage-0002.pt", "stage-0003.pt"]
    stage = torch.load(tmp_path / "ck" / "stage-0002.pt", weights_only=True)
    assert torch.equal(stage["module"]["0.weight"], at_save["2.0.weight"])  # the copy, not the state written later
    assert set(stage) == {"module", "optimizer", "scheduler", "loss_scale"}
    resumed = mpmd.Pipeline.load(tmp_path / "ck", stages=make_stages(4, seed=3), loss_fn=F.mse_loss, optimizer=sgd)
    with resumed:
        assert resumed.engine.step_count == 2 and equal_states(resumed.state_dict(), at_save)
        assert [resumed.step(*batch) for batch in DATA[2:4]] == losses
        assert equal_states(resumed.state_dict(), after)


@pytest.mark.parametrize("blocking, resume_as", [
    (False, {"dp": 1, "num_microbatches": 2 * MICROBATCHES}),            # two replicas resumed as one
    (False, {"num_actors": 4, "schedule": "1f1b"}),                      # another actor count
    (True, {"num_actors": 1, "dp": 1, "num_microbatches": 2 * MICROBATCHES}),
])
def test_a_dp2_save_resumes_elsewhere_equal_to_single_process_training(ray_session, tmp_path, blocking, resume_as):
    stages, data = make_stages(4), make_data(4, 8)
    model, ref_losses = reference_train(stages, data, 2 * MICROBATCHES, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, schedule="interleaved-1f1b", num_microbatches=MICROBATCHES, dp=2,
                       loss_fn=F.mse_loss, optimizer=sgd, device="cpu") as pipe:
        losses = pipe.fit(data[:2], progress=False)
        saved = pipe.save(tmp_path / "ck", blocking=blocking)
        losses_on = pipe.fit(data[2:], progress=False)  # goes on while the shards are written
        path = saved if blocking else saved.result(timeout=60)
        uninterrupted = pipe.state_dict()
    # Only the first replica writes stage files; every actor its RNG state.
    assert sorted(n for n in os.listdir(path) if n.startswith("rng-")) == [f"rng-{i:04d}.pt" for i in range(4)]
    with pytest.warns(UserWarning, match="random number generators start fresh"):
        resumed = mpmd.Pipeline.load(path, stages=make_stages(4, seed=5), loss_fn=F.mse_loss, optimizer=sgd,
                                     **resume_as)
    with resumed:
        losses += resumed.fit(data[2:], progress=False)
        state = resumed.state_dict()
    if resume_as.get("dp", 2) == 2:  # the same replicas: bit for bit
        assert equal_states(state, uninterrupted)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(torch.tensor(losses[2:]), torch.tensor(losses_on), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_a_failed_async_write_surfaces_at_the_next_step_and_at_the_next_save(ray_session, tmp_path):
    flag = tmp_path / "disk-full"
    with faulty_pipeline(flag, UNWRITABLE) as pipe:
        pipe.step(*DATA[0])
        good = pipe.save(tmp_path / "ck")
        before = pipe.state_dict()
        failed = (r"the asynchronous save to .*ck failed: actor 0 \(rank 0, replica 0\) could not write stage 2 to "
                  r".*stage-0002.pt: OSError: \[Errno 28\] No space left on device \(simulated\); nothing was "
                  r"written at .*ck \(a checkpoint there before is intact\)")
        flag.touch()
        pending = pipe.save(good, blocking=False)  # returns: the write fails in the background
        assert pending.wait(timeout=60)
        with pytest.raises(CheckpointError, match=failed):
            pipe.step(*DATA[1])
        pipe.step(*DATA[1])  # raised once; training goes on

        pending = pipe.save(good, blocking=False)
        assert pending.wait(timeout=60)
        with pytest.raises(CheckpointError, match=failed):
            pipe.save(tmp_path / "other")  # the next save raises it (and does not start)
        assert not os.path.exists(tmp_path / "other")
        with pytest.raises(CheckpointError, match=failed):
            pending.result()  # whoever asks the save itself gets it too
        flag.unlink()

        assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary directory left
        pipe.load(good)
        assert equal_states(pipe.state_dict(), before)


def test_fit_with_async_checkpoints_resumes_after_a_failure(ray_session, tmp_path):
    with faulty_pipeline(tmp_path / "unused", UNWRITABLE) as pipe:
        start = pipe.save(tmp_path / "start")
        expected = pipe.fit(DATA, progress=False)
        expected_state = pipe.state_dict()
        pipe.load(start)
        run = tmp_path / "run"

        def fails_after_five():
            for i, batch in enumerate(DATA):
                if i == 5:
                    raise ConnectionError("the data source went away")
                yield batch

        with pytest.raises(ConnectionError):
            pipe.fit(fails_after_five(), checkpoint_dir=run, checkpoint_every=2, checkpoint_async=True,
                     progress=False)
        assert sorted(os.listdir(run)) == ["step-00000002", "step-00000004"]  # complete when fit raised
        history = pipe.fit(DATA, checkpoint_dir=run, checkpoint_every=2, checkpoint_async=True, progress=False)
        assert history == expected
        assert equal_states(pipe.state_dict(), expected_state)
        assert sorted(os.listdir(run)) == ["step-00000002", "step-00000004", "step-00000006"]
        with pytest.raises(ValueError, match="checkpoint_async needs checkpoint_dir"):
            pipe.fit(DATA, checkpoint_async=True)


def test_a_restart_goes_back_to_the_last_complete_async_checkpoint(ray_session, tmp_path):
    """The checkpoint of step 4 is still being written (held) when an actor dies: the restart
    goes back to step 2, the last complete one, and replays the batches since."""
    flag = tmp_path / "hold"
    with faulty_pipeline(flag, HELD) as pipe:
        start = pipe.save(tmp_path / "start")
        expected = pipe.fit(DATA, progress=False)
        expected_state = pipe.state_dict()
        pipe.load(start)
        first = list(pipe.actors)

        def kills_while_step_4_is_written():
            for i, batch in enumerate(DATA):
                if i == 3:  # step 2's checkpoint has its copy; step 4's will be held
                    hold(flag)
                if i == 5:  # step 4's checkpoint was issued and is held
                    assert not checkpoint.is_checkpoint(tmp_path / "run" / "step-00000004")
                    os.unlink(flag)
                    ray.kill(first[1])
                yield batch

        with pytest.warns(UserWarning, match=r"restarting the pipeline's actors \(1 of max_restarts=1\) from "
                                             r".*step-00000002 after"):
            history = pipe.fit(kills_while_step_4_is_written(), checkpoint_dir=tmp_path / "run", checkpoint_every=2,
                               checkpoint_async=True, max_restarts=1, progress=False)
        assert not set(pipe.actors) & set(first)
        assert history == expected
        assert equal_states(pipe.state_dict(), expected_state)
        assert sorted(os.listdir(tmp_path / "run")) == ["step-00000002", "step-00000004", "step-00000006"]


def test_shutdown_waits_for_the_save_in_flight(ray_session, tmp_path):
    """Leaving the pipeline while an actor is still writing its shard: shutdown lets the
    save complete before it stops the actors, so the checkpoint is there, whole."""
    flag = tmp_path / "hold"
    with faulty_pipeline(flag, HELD) as pipe:
        pipe.fit(DATA[:1], progress=False)
        at_save = pipe.state_dict()
        hold(flag)
        pending = pipe.save(tmp_path / "ck", blocking=False)
        os.unlink(flag)
        later = threading.Timer(1.0, lambda: release(flag).join(timeout=60))
        later.start()
    later.join()
    assert pending.done() and pending.result() == str(tmp_path / "ck")
    assert checkpoint.is_checkpoint(tmp_path / "ck")
    with mpmd.Pipeline.load(tmp_path / "ck", stages=make_stages(4, seed=3), loss_fn=F.mse_loss,
                            optimizer=sgd) as resumed:
        assert equal_states(resumed.state_dict(), at_save)
