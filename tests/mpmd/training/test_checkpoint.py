"""Checkpoints: save/load bit for bit on fresh actors and other layouts, atomic writes,
fit's periodic checkpoints and resume; and a saved and resumed run against single-process
training (SGD with momentum: its buffers are state the checkpoint must carry, and a
gradient off by a factor shows, which a resumed run compared only with itself would not)."""

from __future__ import annotations

import json
import os
from contextlib import nullcontext

import pytest
import torch
from torch.nn import functional as F

import mpmd
from mpmd.training import CheckpointError, checkpoint

from tests.models import make_data, make_stages, reference_train, sgd
from tests.mpmd.training.ckpt_faults import UNWRITABLE, FaultyStage

MICROBATCHES = 2
DATA = make_data(6, 8)


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def new_pipeline() -> mpmd.Pipeline:
    """4 stages, interleaved 1F1B on 2 actors (two stages each)."""
    return mpmd.Pipeline(make_stages(4), schedule="interleaved-1f1b", num_microbatches=MICROBATCHES,
                         loss_fn=F.mse_loss, optimizer=sgd, device="cpu")


@pytest.fixture(scope="module")
def pipe(ray_session):
    p = new_pipeline()
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def at_step_2(ray_session, tmp_path_factory):
    """From a fresh pipeline: the checkpoints at 0 and 2 steps, and the parameters 2 more steps
    reach without interruption."""
    with new_pipeline() as fresh:
        start = fresh.save(tmp_path_factory.mktemp("start") / "ck")
        history = fresh.fit(DATA[:2], progress=False)
        path = fresh.save(tmp_path_factory.mktemp("ck") / "step-2")
        later = fresh.fit(DATA[2:4], progress=False)
        return {"start": start, "path": path, "step4": fresh.state_dict(), "history": later,
                "losses": history + later}


def test_the_checkpointed_run_equals_single_process_training(at_step_2):
    # The run every test below compares with is itself right (SGD: a gradient off by a factor shows).
    model, ref_losses = reference_train(make_stages(4), DATA[:4], MICROBATCHES, F.mse_loss, sgd)
    torch.testing.assert_close(torch.tensor(at_step_2["losses"]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(at_step_2["step4"][key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_four_steps_equal_two_plus_save_load_on_fresh_actors_plus_two(at_step_2, recwarn):
    # Fresh actors, and another layout: all 4 stages on one actor.
    fresh = mpmd.Pipeline.load(at_step_2["path"], stages=make_stages(4, seed=123), loss_fn=F.mse_loss,
                               optimizer=sgd, num_actors=1)
    try:
        assert len(fresh.actors) == 1 and fresh.schedule.stage_to_rank == (0, 0, 0, 0)
        assert fresh.schedule.num_microbatches == MICROBATCHES
        assert fresh.config.cluster.device == "auto"  # where to run is not the checkpoint's (Note [what a manifest restores])
        history = fresh.fit(DATA[2:4], progress=False)
        assert equal_states(fresh.state_dict(), at_step_2["step4"])
        assert history == at_step_2["history"]
    finally:
        fresh.shutdown()
    assert any("random number generators start fresh" in str(w.message) for w in recwarn)


def test_load_into_a_running_pipeline_restores_everything(pipe, at_step_2):
    pipe.load(at_step_2["path"])
    assert pipe.fit(DATA[2:4], progress=False) == at_step_2["history"]
    assert equal_states(pipe.state_dict(), at_step_2["step4"])


def test_checkpoint_layout_and_weights_only_files(at_step_2):
    path = at_step_2["path"]
    names = sorted(os.listdir(path))
    assert names == ["manifest.json", "rng-0000.pt", "rng-0001.pt",
                     "stage-0000.pt", "stage-0001.pt", "stage-0002.pt", "stage-0003.pt"]
    manifest = checkpoint.read_manifest(path)
    assert manifest["step"] == 2 and manifest["num_stages"] == 4 and manifest["schedule"] == "interleaved-1f1b"
    assert manifest["config"]["num_microbatches"] == MICROBATCHES
    stage = torch.load(os.path.join(path, "stage-0001.pt"), weights_only=True)
    assert set(stage) == {"module", "optimizer", "scheduler", "loss_scale"}
    assert set(stage["optimizer"]) == {"state", "param_groups"} and stage["scheduler"] is stage["loss_scale"] is None


class NotATensor:
    pass


def test_load_refuses_files_that_are_not_plain_tensors(pipe, at_step_2, tmp_path):
    path = pipe.save(tmp_path / "ck")
    good = torch.load(os.path.join(path, "stage-0000.pt"), weights_only=True)
    torch.save({**good, "extra": NotATensor()}, os.path.join(path, "stage-0000.pt"))
    with pytest.raises(Exception, match="[Ww]eights.only"):
        pipe.load(path)


def test_load_refuses_a_checkpoint_of_other_stages(pipe, tmp_path):
    path = pipe.save(tmp_path / "ck")
    manifest_file = os.path.join(path, checkpoint.MANIFEST)
    with open(manifest_file) as f:
        original = json.load(f)
    manifest = json.loads(json.dumps(original))
    manifest["stage_shapes"][2]["0.weight"] = [8, 5]
    with open(manifest_file, "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match=r"does not fit stage 2 \(Sequential\): .*0.weight: saved \(8, 5\), "
                                         r"module \(8, 8\)"):
        pipe.load(path)
    with open(manifest_file, "w") as f:  # the manifest is right but a stage file is not
        json.dump(original, f)
    other = torch.load(os.path.join(path, "stage-0001.pt"), weights_only=True)
    other["module"] = {"fc.weight": torch.zeros(8, 8)}
    torch.save(other, os.path.join(path, "stage-0001.pt"))
    with pytest.raises(ValueError, match=r"does not fit stage 1 \(Block\): missing keys \['fc.bias'"):
        pipe.load(path)
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        pipe.load(tmp_path / "nothing-here")


def test_a_failed_shard_write_leaves_the_previous_checkpoint_loadable(ray_session, tmp_path):
    """The actors write their own files: one actor's write of stage 2 fails (a full disk,
    simulated inside the actor).  The save raises naming the actor and the stage, no half
    checkpoint is visible, the previous one still loads, and the pipeline trains on."""
    flag = tmp_path / "disk-full"
    stages = make_stages(4)
    stages[2] = FaultyStage(flag, UNWRITABLE, *stages[2])  # on actor 0 (interleaved: stages 0 and 2)
    with mpmd.Pipeline(stages, schedule="interleaved-1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=sgd, device="cpu") as pipe:
        pipe.step(*DATA[0])
        before = pipe.state_dict()
        root = tmp_path / "run"
        previous = pipe.save(root / checkpoint.checkpoint_name(1))
        pipe.step(*DATA[1])  # the state moves on; the next saves fail
        flag.touch()
        failed = (r"saving the checkpoint .*{name} failed: actor 0 \(rank 0, replica 0\) could not write stage 2 "
                  r"to .*stage-0002.pt: OSError: \[Errno 28\] No space left on device \(simulated\); nothing was "
                  r"written at .*{name} \(a checkpoint there before is intact\)")
        with pytest.raises(CheckpointError, match=failed.format(name=checkpoint.checkpoint_name(2))):
            pipe.save(root / checkpoint.checkpoint_name(2))
        with pytest.raises(CheckpointError, match=failed.format(name=checkpoint.checkpoint_name(1))):
            pipe.save(previous)  # overwriting the previous checkpoint itself
        flag.unlink()
        pipe.step(*DATA[2])  # a failed save does not fail the pipeline

        assert sorted(os.listdir(root)) == [checkpoint.checkpoint_name(1)]  # no half-written directory left
        os.makedirs(root / checkpoint.checkpoint_name(9))  # a torn directory from a killed process: no manifest
        assert checkpoint.latest_checkpoint(root) == previous
        pipe.load(root)
        assert equal_states(pipe.state_dict(), before)

        # A crash between the two renames of an overwrite leaves the previous one at .NAME.old-*.
        pipe.step(*DATA[2])
        os.rename(previous, root / f".{checkpoint.checkpoint_name(1)}.old-crashed")
        assert checkpoint.latest_checkpoint(root) == str(root / ".step-00000001.old-crashed")
        pipe.load(previous)
        assert equal_states(pipe.state_dict(), before)


def test_fit_checkpoints_periodically_and_resumes(pipe, at_step_2, tmp_path):
    pipe.load(at_step_2["start"])
    expected = pipe.fit(DATA, progress=False)
    expected_state = pipe.state_dict()

    pipe.load(at_step_2["start"])
    run = tmp_path / "run"

    def fails_after_three():
        for i, batch in enumerate(DATA):
            if i == 3:
                raise ConnectionError("the data source went away")
            yield batch

    with pytest.raises(ConnectionError):
        pipe.fit(fails_after_three(), checkpoint_dir=run, checkpoint_every=2, progress=False)
    assert sorted(os.listdir(run)) == ["step-00000002"]

    # A new run over the same data resumes at step 2 and skips the two batches it had used.
    history = pipe.fit(DATA, checkpoint_dir=run, checkpoint_every=2, keep_checkpoints=1, progress=False)
    assert history == expected
    assert equal_states(pipe.state_dict(), expected_state)
    # keep_checkpoints prunes what this call wrote (step 4), never what it did not.
    assert sorted(os.listdir(run)) == ["step-00000002", "step-00000006"]
    # Everything was done: resuming again trains nothing.
    assert pipe.fit(DATA, checkpoint_dir=run, progress=False) == expected
    assert equal_states(pipe.state_dict(), expected_state)


def test_fit_refuses_bad_checkpoint_options(pipe, tmp_path):
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        pipe.fit(DATA, checkpoint_every=2)
    with pytest.raises(ValueError, match="checkpoint_every must be a positive number of steps, got 0"):
        pipe.fit(DATA, checkpoint_dir=tmp_path, checkpoint_every=0)
    with pytest.raises(ValueError, match="max_restarts needs checkpoint_dir"):
        pipe.fit(DATA, max_restarts=1)
    with pytest.raises(ValueError, match="max_restarts must be an integer >= 0, got -1"):
        pipe.fit(DATA, checkpoint_dir=tmp_path, max_restarts=-1)
    with pytest.raises(ValueError, match=r"keep_checkpoints must be >= 1 or None \(keep all\), got 0"):
        pipe.fit(DATA, checkpoint_dir=tmp_path, keep_checkpoints=0)
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        pipe.fit(DATA, epochs=0)
    assert os.listdir(tmp_path) == []


def test_load_refuses_bad_requests(pipe, tmp_path):
    path = pipe.save(tmp_path / "ck")
    with pytest.raises(ValueError, match=r"Pipeline.load\(path, stages=\[...\]\) needs the stages \(modules or factories\)"):
        mpmd.Pipeline.load(path)
    with pytest.raises(ValueError, match=r"pipe.load\(path\) takes no options \(got \['num_actors'\]\)"):
        pipe.load(path, num_actors=1)
    manifest_file = os.path.join(path, checkpoint.MANIFEST)
    with open(manifest_file) as f:
        manifest = json.load(f)
    with open(manifest_file, "w") as f:
        json.dump({**manifest, "schedule": "mine"}, f)
    with pytest.raises(ValueError, match=r"written with the schedule 'mine', which is not a registered name; "
                                         r"pass schedule=..."):
        mpmd.Pipeline.load(path, stages=make_stages(4))
    with open(manifest_file, "w") as f:
        json.dump({**manifest, "format": "something-else/3"}, f)
    with pytest.raises(ValueError, match=r"is not an mpmd checkpoint of format 'mpmd-checkpoint/1' "
                                         r"\(got 'something-else/3'\)"):
        pipe.load(path)


@pytest.mark.parametrize("schedule, num_stages, dp, resume_as", [
    ("zb-h1", 2, 1, {"schedule": "1f1b"}),             # the split backward's run, resumed under fused B
    ("1f1b", 2, 2, {"dp": 1, "num_microbatches": 4}),  # two replicas, resumed as one on the same microbatches
])
def test_save_then_resume_elsewhere_equals_single_process_training(ray_session, tmp_path, schedule, num_stages,
                                                                    dp, resume_as):
    stages, data = make_stages(num_stages), make_data(4, 8)
    model, ref_losses = reference_train(stages, data, MICROBATCHES * dp, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd,
                       dp=dp, device="cpu") as pipe:
        losses = pipe.fit(data[:2], progress=False)
        path = pipe.save(tmp_path / "ck")
    other_layout = resume_as.get("dp", dp) != dp  # the RNG states then start fresh (no dropout here)
    with pytest.warns(UserWarning, match=r"random number generators start fresh") if other_layout else nullcontext():
        resumed = mpmd.Pipeline.load(path, stages=make_stages(num_stages, seed=5), loss_fn=F.mse_loss, optimizer=sgd,
                                     **resume_as)
    with resumed:
        assert resumed.engine.step_count == 2
        losses += resumed.fit(data[2:], progress=False)
        state = resumed.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
