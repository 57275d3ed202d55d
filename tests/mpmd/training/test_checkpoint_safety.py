"""What a checkpoint from elsewhere, a careless path or a long run can do to the user: nothing.

A manifest restores how to train, never where to run (Note [what a manifest restores]); a save
replaces only a checkpoint (Note [save replaces only a checkpoint]); a manifest keeps a bounded
history and resume counts from a stored step counter (Note [fit's kept history]); a resume
passes over an unreadable newest checkpoint; leftovers of dead saves are swept; restarts need
periodic checkpoints; finished fill jobs' inputs are released (Note [finished fill jobs])."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd
from mpmd.training import CheckpointError, checkpoint, fit as fit_module

from tests.fill_jobs import infer
from tests.models import make_data, make_stages, reference_train, sgd

DATA = make_data(10, 8)


def _pipeline(**options) -> mpmd.Pipeline:
    return mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd,
                         device="cpu", **options)


@pytest.fixture(scope="module")
def saved(ray_session, tmp_path_factory):
    """A checkpoint after two steps, and the state it holds."""
    with _pipeline() as pipe:
        pipe.fit(DATA[:2], progress=False)
        path = pipe.save(tmp_path_factory.mktemp("saved") / "ck")
        return path, pipe.state_dict()


def _edit_manifest(path, edit) -> None:
    file = os.path.join(path, checkpoint.MANIFEST)
    with open(file) as f:
        manifest = json.load(f)
    edit(manifest)
    with open(file, "w") as f:
        json.dump(manifest, f)


def test_a_manifest_never_says_where_to_run(saved, tmp_path, caplog):
    path, state = saved
    with open(os.path.join(path, checkpoint.MANIFEST)) as f:
        written = json.load(f)
    assert set(written["config"]) <= set(checkpoint.RESTORED_OPTIONS)
    assert not {"address", "device", "num_cpus", "num_gpus", "placement", "spare_actors", "transport"} \
        & set(written["config"])
    # A downloaded checkpoint that names another cluster, devices and resources.
    crafted = tmp_path / "crafted"
    shutil.copytree(path, crafted)
    _edit_manifest(crafted, lambda m: (m["config"].update(address="ray://198.51.100.7:10001", device="cuda",
                                                          num_cpus=64, spare_actors=1000),
                                       m["batching"].update(address="ray://198.51.100.7:10001")))
    with caplog.at_level(logging.WARNING, logger="mpmd.training.checkpoint"):
        path_, options = checkpoint.checkpoint_arguments(str(crafted), {})
    assert not {"address", "device", "num_cpus", "spare_actors"} & set(options)
    assert options["num_microbatches"] == 2 and options["schedule"] == "1f1b"
    assert "address='ray://198.51.100.7:10001'" in caplog.text and "are ignored" in caplog.text
    # ... and loads here, on the local Ray, onto CPU actors.
    with mpmd.Pipeline.load(str(crafted), stages=make_stages(2, seed=5), loss_fn=F.mse_loss, optimizer=sgd) as pipe:
        cluster = pipe.config.cluster
        assert cluster.address is None and cluster.device == "auto" and cluster.spare_actors == 0
        loaded = pipe.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in state.items())


def test_a_malformed_manifest_is_refused_as_unreadable(saved, tmp_path):
    crafted = tmp_path / "crafted"
    shutil.copytree(saved[0], crafted)
    _edit_manifest(crafted, lambda m: m.update(config=["address", "ray://198.51.100.7:10001"]))
    with pytest.raises(checkpoint.UnreadableCheckpointError, match=r"manifest of .* is malformed: config"):
        checkpoint.checkpoint_arguments(str(crafted), {})
    with open(crafted / checkpoint.MANIFEST, "w") as f:
        f.write("{not json")
    with pytest.raises(checkpoint.UnreadableCheckpointError, match=r"manifest of .* cannot be read"):
        checkpoint.read_manifest(str(crafted))


def test_save_replaces_only_a_checkpoint(ray_session, tmp_path, monkeypatch):
    run = tmp_path / "exp1"
    run.mkdir()
    (run / "notes.txt").write_text("three weeks of notes")
    with _pipeline() as pipe:
        for blocking in (True, False):
            with pytest.raises(FileExistsError, match=r"exp1 is a directory that is not a checkpoint \(it holds "
                                                      r"notes.txt\); saving there would delete it"):
                pipe.save(run, blocking=blocking)
        monkeypatch.chdir(run)
        with pytest.raises(FileExistsError, match="not a checkpoint"):
            pipe.save(".")
        assert sorted(os.listdir(run)) == ["notes.txt"] and (run / "notes.txt").read_text() == "three weeks of notes"
        (tmp_path / "a-file").write_text("x")
        with pytest.raises(FileExistsError, match="exists and is not a directory"):
            pipe.save(tmp_path / "a-file")
        (tmp_path / "empty").mkdir()
        assert checkpoint.is_checkpoint(pipe.save(tmp_path / "empty"))
        pipe.fit(DATA[:1], progress=False)
        assert pipe.save(tmp_path / "empty", blocking=False).result() == str(tmp_path / "empty")  # over a checkpoint
        assert checkpoint.read_manifest(str(tmp_path / "empty"))["step"] == 1
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary directory left


def test_resume_past_the_kept_history_skips_by_the_stored_count(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(fit_module, "HISTORY_KEPT", 2)
    run = tmp_path / "run"
    with _pipeline() as pipe:
        first = pipe.fit(DATA[:6], checkpoint_dir=run, checkpoint_every=2, progress=False)
    manifest = checkpoint.read_manifest(checkpoint.latest_checkpoint(run))
    assert manifest["fit"]["steps"] == 6 and manifest["fit"]["history"] == first[-2:]
    assert manifest["fit"]["records"]["step"] == [5, 6]
    with _pipeline() as pipe:  # the whole data again: the first 6 batches are skipped by count
        resumed = pipe.fit(DATA, checkpoint_dir=run, checkpoint_every=2, progress=False)
        state = pipe.state_dict()
    assert resumed.steps == [5, 6, 7, 8, 9, 10]
    ref, ref_losses = reference_train(make_stages(2), DATA, 2, F.mse_loss, sgd)
    torch.testing.assert_close(torch.tensor(first + resumed[2:]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7)
    assert checkpoint.read_manifest(checkpoint.latest_checkpoint(run))["fit"]["steps"] == 10


def test_resume_passes_over_an_unreadable_newest_checkpoint(ray_session, tmp_path):
    run = tmp_path / "run"
    with _pipeline() as pipe:
        pipe.fit(DATA[:4], checkpoint_dir=run, checkpoint_every=2, progress=False)
    assert sorted(os.listdir(run)) == ["step-00000002", "step-00000004"]
    with open(run / "step-00000004" / "stage-0001.pt", "wb") as f:
        f.write(b"truncated")
    with _pipeline() as pipe:
        with pytest.warns(UserWarning, match=r"step-00000004 cannot be read .*; trying the one before it"):
            resumed = pipe.fit(DATA[:6], checkpoint_dir=run, checkpoint_every=2, progress=False)
        state = pipe.state_dict()
    assert resumed.steps == [1, 2, 3, 4, 5, 6]  # the kept two, then 3..6 trained again
    ref, ref_losses = reference_train(make_stages(2), DATA[:6], 2, F.mse_loss, sgd)
    torch.testing.assert_close(torch.tensor(list(resumed)), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-7)
    # When none can be read, the newest's error is raised.
    for name in os.listdir(run):
        with open(run / name / checkpoint.MANIFEST, "w") as f:
            f.write("{")
    with _pipeline() as pipe:
        with pytest.warns(UserWarning, match="cannot be read"), \
                pytest.raises(CheckpointError, match=r"no checkpoint under .*run could be read; the newest: the "
                                                     r"manifest of .*step-00000006 cannot be read"):
            pipe.fit(DATA[:6], checkpoint_dir=run, progress=False)


def test_leftovers_of_dead_saves_are_swept_by_the_next(ray_session, tmp_path):
    run = tmp_path / "run"
    for leftover in (".step-00000002.tmp-dead1", ".step-00000007.tmp-dead2", ".step-00000002.old-0a1b2c3d"):
        (run / leftover).mkdir(parents=True)
    (run / ".step-00000009.old-0a1b2c3d").mkdir()  # newer than anything written: another run's fallback
    (run / "notes.txt").write_text("kept")
    with _pipeline() as pipe:
        pipe.fit(DATA[:4], checkpoint_dir=run, checkpoint_every=2, progress=False)
    assert sorted(os.listdir(run)) == [".step-00000009.old-0a1b2c3d", "notes.txt", "step-00000002", "step-00000004"]


def test_restarts_need_periodic_checkpoints(ray_session, tmp_path):
    with _pipeline() as pipe:
        with pytest.raises(ValueError, match=r"max_restarts needs checkpoint_dir and checkpoint_every \(restarts "
                                             r"resume from the last checkpoint and replay the batches since"):
            pipe.fit(DATA, checkpoint_dir=tmp_path, max_restarts=1)
    assert os.listdir(tmp_path) == []


def test_a_finished_fill_jobs_inputs_are_released_everywhere(ray_session):
    inputs = [torch.randn(6) for _ in range(16)]
    with _pipeline() as pipe:
        job = pipe.add_fill_job(mpmd.FillJob(fn=infer, data=inputs, cost_per_sample=1e-6), min_bubble_s=1e-6)
        registered = [pipe.actors[i].__ray_call__.remote(lambda worker: sorted(worker.fill.jobs)) for i in range(2)]
        assert [list(r) for r in ray.get(registered)] == [[job.id], [job.id]]
        for x, y in DATA * 20:  # bubbles here are microseconds: as many steps as it takes
            pipe.step(x, y)
            if job.done():
                break
        assert job.done(), pipe.fill_summary()
        results = job.results()
        assert job.data == [] and job.num_inputs == 16
        left = [pipe.actors[i].__ray_call__.remote(lambda worker: sorted(worker.fill.jobs)) for i in range(2)]
        assert ray.get(left) == [[], []]
    torch.testing.assert_close(torch.stack(results), infer(torch.stack(inputs)))

