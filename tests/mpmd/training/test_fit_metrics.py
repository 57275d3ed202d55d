"""fit's metrics: each step's record to the callbacks, the CSV and TensorBoard loggers (also
across a resume and a restart), the history fit returns, and the progress display (plain
lines when stderr is not a terminal, a tqdm bar when it is, nothing with progress=False).

Every fit here starts from the same saved state, so its losses are compared with the
single-process reference (SGD with momentum, ``tests.models.reference_train``)."""

from __future__ import annotations

import csv
import io
import pickle
import re
import sys

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd
from mpmd.training import STEP_FIELDS, CSVLogger, FitHistory, FitOptions, TensorBoardLogger

from tests.models import make_data, make_stages, reference_records, reference_train, sgd

MICROBATCHES = 2
BATCH = 8
DATA = make_data(6, BATCH)
RTOL, ATOL = 1e-5, 1e-7
REFERENCE_LOSSES = reference_train(make_stages(2), DATA, MICROBATCHES, F.mse_loss, sgd)[1]


@pytest.fixture(scope="module")
def pipe(ray_session):
    with mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=sgd, device="cpu") as p:
        yield p


@pytest.fixture(scope="module")
def start(pipe, tmp_path_factory):
    return pipe.save(tmp_path_factory.mktemp("start") / "ck")


@pytest.fixture
def fresh(pipe, start):
    """The module's pipeline at step 0 with its initial parameters."""
    pipe.load(start)
    return pipe


class Recorder:
    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.logged: list[dict] = []
        self.ends = 0

    def on_step(self, record: dict) -> None:
        self.steps.append(record)

    def on_log(self, record: dict) -> None:
        self.logged.append(record)

    def on_end(self) -> None:
        self.ends += 1


def assert_reference(losses) -> None:
    torch.testing.assert_close(torch.tensor(list(losses)), torch.tensor(REFERENCE_LOSSES), rtol=RTOL, atol=ATOL)


def csv_rows(path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        header = next(csv.reader(f))
        f.seek(0)
        return header, list(csv.DictReader(f))


def fails_before(n: int):
    """DATA's batches; asking for batch ``n`` raises (the data source went away)."""
    for i, batch in enumerate(DATA):
        if i == n:
            raise ConnectionError("the data source went away")
        yield batch


# -- records and callbacks -------------------------------------------------------------------------------
def test_a_callback_gets_one_record_per_step_equal_to_the_history_and_the_reference(fresh):
    recorder, seen = Recorder(), []
    history = fresh.fit(DATA, progress=False, callbacks=[recorder, seen.append], log_every=4, tokens_per_sample=5)
    assert_reference(history)
    assert isinstance(history, list) and history == [r["loss"] for r in recorder.steps]
    assert [r["step"] for r in recorder.steps] == [1, 2, 3, 4, 5, 6] == history.steps
    assert seen == recorder.steps == history.records  # a function is called every step too
    assert [r["step"] for r in recorder.logged] == [4, 6]  # every log_every-th step and the last
    assert recorder.ends == 1
    for r in recorder.steps:
        assert set(STEP_FIELDS) <= set(r)
        assert r["grad_norm"] is None and r["skipped"] is False  # no clip_grad_norm, nothing skipped
        assert r["lr"] is None or r["lr"] == pytest.approx(0.05)  # sgd's lr where the actors report it
        assert r["samples"] == BATCH and r["step_time_s"] > 0
        assert r["samples_per_s"] == pytest.approx(BATCH / r["step_time_s"])
        assert r["tokens_per_s"] == pytest.approx(5 * r["samples_per_s"])
    assert history.grad_norms == [None] * 6 and history.lrs == [r["lr"] for r in recorder.steps]


def test_without_tokens_per_sample_tokens_per_s_is_none(fresh):
    history = fresh.fit(DATA[:2], progress=False)
    assert [r["tokens_per_s"] for r in history.records] == [None, None]


def test_a_callback_that_raises_stops_fit_after_every_on_end(fresh, tmp_path):
    before, after = Recorder(), Recorder()
    logger = CSVLogger(tmp_path / "m.csv")

    def fails_at_step_3(record):
        if record["step"] == 3:
            raise RuntimeError("the metrics server is down")

    with pytest.raises(RuntimeError, match="the metrics server is down") as info:
        fresh.fit(DATA, progress=False, callbacks=[before, logger, fails_at_step_3, after], log_every=1)
    assert any("fit callback" in note and "step 3" in note for note in getattr(info.value, "__notes__", [""])) \
        or sys.version_info < (3, 11)
    assert [r["step"] for r in before.steps] == [1, 2, 3] and [r["step"] for r in after.steps] == [1, 2]
    assert before.ends == after.ends == 1
    assert [r["step"] for r in csv_rows(tmp_path / "m.csv")[1]] == ["1", "2"]  # closed, rows kept

    class FailsToClose(Recorder):
        def on_end(self):
            raise OSError("disk full")

    last = Recorder()
    with pytest.raises(OSError, match="disk full"):
        fresh.fit(DATA[:2], progress=False, callbacks=[FailsToClose(), last])
    assert last.ends == 1 and len(last.steps) == 2


def test_bad_callback_options_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"callbacks\[1\] \(42\) is not a callback: pass a function"):
        FitOptions(callbacks=[print, 42])
    with pytest.raises(ValueError, match="log_every must be a positive number of steps, got 0"):
        FitOptions(log_every=0)
    with pytest.raises(ValueError, match="tokens_per_sample must be a positive integer"):
        FitOptions(tokens_per_sample=0)
    assert FitOptions(callbacks=print).callbacks == (print,)  # one callback alone is taken too


def test_fit_history_is_a_list_of_the_losses_with_records():
    a = FitHistory([1.0, 2.0])
    a.add({"step": 3, "loss": 0.5, "grad_norm": 2.0, "lr": 0.1})
    assert a == [1.0, 2.0, 0.5] and a.grad_norms == [None, None, 2.0] and a.lrs == [None, None, 0.1]
    b = FitHistory([0.25], [{"step": 4, "loss": 0.25, "lr": 0.2}])
    assert (a + b).steps == [None, None, 3, 4] and a + [7.0] == [1.0, 2.0, 0.5, 7.0]
    a += b
    assert a == [1.0, 2.0, 0.5, 0.25] and a.lrs[-1] == 0.2
    assert pickle.loads(pickle.dumps(a)).records == a.records
    with pytest.raises(ValueError, match="2 losses but 1 records"):
        FitHistory([1.0, 2.0], [{}])


# -- loggers ----------------------------------------------------------------------------------------------
class AssertsFlushed:
    """After CSVLogger in the callbacks: the row of each logged step is on disk already."""

    def __init__(self, path) -> None:
        self.path = path

    def on_log(self, record: dict) -> None:
        assert csv_rows(self.path)[1][-1]["step"] == str(record["step"])


def test_csv_logger_writes_a_row_per_step_and_a_resumed_fit_appends(fresh, tmp_path):
    path, run = tmp_path / "metrics.csv", tmp_path / "run"
    # Checkpoint at step 2; steps 1-3 complete before the data fails (step 4 is left in flight).
    with pytest.raises(ConnectionError):
        fresh.fit(fails_before(4), progress=False, checkpoint_dir=run, checkpoint_every=2,
                  callbacks=[CSVLogger(path), AssertsFlushed(path)], log_every=1)
    header, rows = csv_rows(path)
    assert header == list(STEP_FIELDS) and [r["step"] for r in rows] == ["1", "2", "3"]

    # The resumed fit goes on from step 2's checkpoint: step 3's row is written again, once.
    history = fresh.fit(DATA, progress=False, checkpoint_dir=run, callbacks=[CSVLogger(path)], log_every=1)
    assert_reference(history)
    header, rows = csv_rows(path)
    assert header == list(STEP_FIELDS)
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert_reference(float(r["loss"]) for r in rows)
    assert {r["samples"] for r in rows} == {str(BATCH)} and {r["grad_norm"] for r in rows} == {""}
    assert {r["skipped"] for r in rows} == {"False"}
    # The history holds the steps before the resume, from the checkpoint (without timings).
    assert history.steps == [1, 2, 3, 4, 5, 6]
    assert [r["step_time_s"] is None for r in history.records] == [True, True, False, False, False, False]


def test_csv_logger_writes_every_log_every_steps_and_the_last(fresh, tmp_path):
    logger = CSVLogger(tmp_path / "sub" / "m.csv")
    fresh.fit(DATA[:5], progress=False, callbacks=[logger], log_every=2)
    fresh.fit(DATA[5:], progress=False, callbacks=[logger], log_every=2)  # the same logger, a second fit
    assert [r["step"] for r in csv_rows(tmp_path / "sub" / "m.csv")[1]] == ["2", "4", "5", "6"]


def test_tensorboard_logger_writes_the_scalars_and_replaces_them_on_resume(fresh, tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install 'mpmd[tensorboard]')")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logs, run = tmp_path / "tb", tmp_path / "run"
    with pytest.raises(ConnectionError):
        fresh.fit(fails_before(4), progress=False, checkpoint_dir=run, checkpoint_every=2,
                  callbacks=[TensorBoardLogger(logs)], log_every=1)
    history = fresh.fit(DATA, progress=False, checkpoint_dir=run, callbacks=[TensorBoardLogger(logs)], log_every=1)
    events = EventAccumulator(str(logs))
    events.Reload()
    assert {"train/loss", "train/samples_per_s", "train/step_time_s"} <= set(events.Tags()["scalars"])
    assert "train/grad_norm" not in events.Tags()["scalars"]  # None: not written
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3, 4, 5, 6]  # step 3 of the failed run purged
    torch.testing.assert_close(torch.tensor([e.value for e in loss]), torch.tensor(history), rtol=1e-6, atol=0)


def test_tensorboard_logger_without_tensorboard_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=re.escape("pip install 'mpmd[tensorboard]'")):
        TensorBoardLogger(tmp_path)


# -- the progress display ----------------------------------------------------------------------------------
def test_progress_off_a_terminal_prints_a_plain_line_every_log_every_steps(fresh, capsys):
    history = fresh.fit(DATA, callbacks=[], log_every=4)
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [line for line in err.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == ["4/6", "6/6"]
    assert f"loss {history[3]:.4f}" in lines[0] and f"loss {history[5]:.4f}" in lines[1]
    assert all("steps/s" in line for line in lines)


def test_progress_false_prints_nothing(fresh, capsys):
    fresh.fit(DATA, progress=False, log_every=1)
    assert capsys.readouterr().err == ""


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_terminal_is_a_tqdm_bar(fresh, monkeypatch):
    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    history = fresh.fit(DATA, log_every=4, tokens_per_sample=5)
    out = terminal.getvalue()
    assert "\r" in out and "6/6" in out and "step/s" in out and "tokens/s" in out
    assert f"loss {history[-1]:.4f}" in out
    assert_reference(history)


def wait_until_dead(handle, calls: int = 1000) -> None:
    for _ in range(calls):  # each call is answered, or fails once the actor is gone
        try:
            ray.get(handle.pid.remote(), timeout=60)
        except ray.exceptions.RayActorError:
            return
    raise AssertionError(f"the actor still answers {calls} calls after ray.kill")


# -- a restart ----------------------------------------------------------------------------------------------
def test_after_a_restart_callbacks_see_the_steps_again_and_the_csv_holds_each_once(fresh, tmp_path, capsys):
    first_actors = list(fresh.actors)

    def kills_rank_1_before_step_4():
        for i, batch in enumerate(DATA):
            if i == 3:
                ray.kill(first_actors[1])
                wait_until_dead(first_actors[1])  # dead before the batch is issued
            yield batch

    recorder, path = Recorder(), tmp_path / "m.csv"
    with pytest.warns(UserWarning, match=r"restarting the pipeline's actors \(1 of max_restarts=1\)"):
        history = fresh.fit(kills_rank_1_before_step_4(), checkpoint_dir=tmp_path / "run", checkpoint_every=2,
                            max_restarts=1, callbacks=[recorder, CSVLogger(path)], log_every=1)
    assert_reference(history)
    steps = [r["step"] for r in recorder.steps]
    assert steps[:2] == [1, 2] and steps[-4:] == [3, 4, 5, 6] and len(steps) in (6, 7)  # step 3 maybe twice
    rows = csv_rows(path)[1]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 6]
    assert_reference(float(r["loss"]) for r in rows)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    counts = [line.split()[1] for line in lines]  # "step N": a generator has no length
    assert counts[:2] == ["1", "2"] and counts[-4:] == ["3", "4", "5", "6"]  # the count went back


# -- the training recipe's numbers: grad norm and lr -----------------------------------------------------------
CLIP = 0.05


def warmup(opt):
    return torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=4)


def test_grad_norm_and_lr_reach_the_records_the_csv_the_lines_and_a_resumed_history(ray_session, tmp_path, capsys):
    # (loss, grad norm before clipping, lr) per step
    expected = torch.tensor(reference_records(make_stages(2), DATA, MICROBATCHES, F.mse_loss, sgd, clip=CLIP,
                                              lr_scheduler=warmup)[1])
    path, run = tmp_path / "m.csv", tmp_path / "run"
    with mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=sgd, lr_scheduler=warmup, clip_grad_norm=CLIP, device="cpu") as p:
        with pytest.raises(ConnectionError):
            p.fit(fails_before(4), checkpoint_dir=run, checkpoint_every=2, callbacks=[CSVLogger(path)], log_every=2)
        recorder = Recorder()
        history = p.fit(DATA, checkpoint_dir=run, callbacks=[CSVLogger(path), recorder], log_every=2)
    got = torch.tensor([[r["loss"], r["grad_norm"], r["lr"]] for r in history.records])
    torch.testing.assert_close(got, expected, rtol=RTOL, atol=ATOL)  # steps 1-2 from the checkpoint
    assert history.grad_norms == [r["grad_norm"] for r in history.records] and len(history.lrs) == 6
    assert [r["step"] for r in recorder.steps] == [3, 4, 5, 6] and recorder.steps == history.records[2:]
    rows = csv_rows(path)[1]
    assert [r["step"] for r in rows] == ["2", "4", "6"]
    torch.testing.assert_close(torch.tensor([[float(r["grad_norm"]), float(r["lr"])] for r in rows]),
                               expected[1::2, 1:], rtol=RTOL, atol=ATOL)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("step ")]
    assert lines[-1].startswith("step 6/6") and f"grad_norm {history.grad_norms[-1]:.4g}" in lines[-1]
    assert f"lr {history.lrs[-1]:.3g}" in lines[-1]
