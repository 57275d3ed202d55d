"""Device timing (Note [device timing] in actors/timing.py) through fakes of CUDA's synchronise and
events: on a device whose kernels run after their launch returns, the times are the kernels',
and the timer synchronises only where the Note says (twice per profiled step, around each fill
chunk), never per instruction."""

from __future__ import annotations

import ast
import contextlib
import pathlib

import pytest
import torch

from actors.fill import FillRunner
from actors.protocol import FillChunk, FillSlot
from actors.timing import DeviceTimer, device_timer


class FakeCuda:
    """A device whose queued work finishes ``queued_ms`` after the host launched it: the host
    clock stays where it is until a synchronise, which waits for the queue."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.device_ms = 0.0  # when the queued work ends
        self.host_ms = 0.0

    def launch(self, ms: float) -> None:
        self.device_ms += ms  # returns at once, as a kernel launch does

    def synchronize(self) -> None:
        self.log.append("sync")
        self.host_ms = max(self.host_ms, self.device_ms)

    def event(self) -> "FakeEvent":
        return FakeEvent(self)

    def timer(self) -> DeviceTimer:
        return DeviceTimer(synchronize=self.synchronize, event=self.event,
                           wall_ns=lambda: 10**12 + int(self.host_ms * 1e6), perf=lambda: self.host_ms / 1e3)


class FakeEvent:
    def __init__(self, cuda: FakeCuda) -> None:
        self.cuda, self.at = cuda, None

    def record(self) -> None:
        self.cuda.log.append("record")
        self.at = self.cuda.device_ms  # the event completes when the work queued before it does

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.at - self.at


def test_a_profiled_steps_timeline_holds_the_kernels_time_with_two_synchronisations():
    cuda = FakeCuda()
    timer = cuda.timer()
    timer.begin()
    timeline = []
    for i, ms in enumerate((2.0, 5.0, 0.5)):  # three instructions launching kernels of these lengths
        t0 = timer.mark()
        cuda.launch(ms)
        timeline.append((i, t0, timer.mark()))
    assert cuda.log == ["sync", "record"] + ["record"] * 6  # no synchronise per instruction
    assert cuda.host_ms == 0.0  # the host never waited: a host clock would say every instruction took 0
    resolved = timer.resolve(timeline)
    assert cuda.log[-1] == "sync" and cuda.log.count("sync") == 2
    busy = [(b - a) / 1e6 for _, a, b in resolved]
    assert busy == [2.0, 5.0, 0.5]
    assert resolved[0][1] == 10**12 and resolved[-1][2] == 10**12 + int(7.5e6)  # on the host's clock
    with pytest.raises(RuntimeError, match=r"resolve without begin\(\)"):
        cuda.timer().resolve(timeline)


def test_on_the_cpu_nothing_synchronises_and_marks_are_the_host_clock():
    timer = device_timer(torch.device("cpu"))
    assert timer is device_timer(torch.device("cpu"))
    timer.begin()
    a = timer.mark()
    b = timer.mark()
    assert isinstance(a, int) and b >= a and timer.resolve([(0, a, b)]) == [(0, a, b)]


def test_fill_chunks_are_timed_to_the_end_of_their_kernels():
    cuda = FakeCuda()
    runner = FillRunner(cuda.timer())
    runner.register(0, lambda xs: (cuda.launch(3.0 * len(xs)), torch.stack(xs) * 2)[1], False,
                    [torch.ones(2) for _ in range(4)])
    slot = FillSlot(chunks=(FillChunk(0, 0, 2, 0.001), FillChunk(0, 2, 2, 0.001)), budget_s=1.0)
    results = runner.run_slot(slot, torch.device("cpu"), lambda: False)
    assert [r.seconds for r in results] == pytest.approx([0.006, 0.006])  # the kernels' 6 ms, not the launch's 0
    assert all(entry == "sync" for entry in cuda.log) and len(cuda.log) == 7  # slot start, per chunk: check, start, end
    # A slot whose budget the device time has spent skips its next chunk (the launch time would not have).
    slot = FillSlot(chunks=(FillChunk(0, 0, 2, 0.001), FillChunk(0, 2, 2, 0.001)), budget_s=0.005)
    assert [r.skipped for r in runner.run_slot(slot, torch.device("cpu"), lambda: False)] == [False, True]


def test_no_step_waits_for_the_whole_device_while_it_has_operations_posted():
    """Note [device timing]: ``torch.cuda.synchronize`` only in the device's timer, whose
    ``seconds`` only the link probes (between steps) read; fill chunks use a timer of their
    own stream.  (Waiting for the device in a fill slot waits for every posted NCCL receive
    and send: the slot skips every chunk, and two ranks filling at once can hang.)"""
    root = pathlib.Path(__file__).resolve().parents[2] / "actors"
    syncs, reads = [], []
    for path in sorted(root.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                text = ast.unparse(node) if isinstance(node, ast.Attribute) else ""
                if text == "torch.cuda.synchronize":
                    syncs.append((path.name, fn.name))
                elif text == "self.timer.seconds":
                    reads.append((path.name, fn.name))
    assert set(syncs) == {("timing.py", "device_timer")}, syncs
    assert set(reads) == {("probes.py", "probe_links")}, reads
    assert "device_timer" not in (root / "fill.py").read_text()


def test_fill_chunks_run_on_a_stream_of_their_own(monkeypatch):
    """On CUDA a chunk runs under ``torch.cuda.stream`` of the runner's stream and waits for that
    stream alone (a fake CUDA: the calls are recorded, nothing runs on a GPU)."""
    calls = []

    class Stream:
        def synchronize(self):
            calls.append("stream sync")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("DEVICE SYNC"))
    monkeypatch.setattr(torch.cuda, "stream", lambda s: (calls.append("on fill stream"), contextlib.nullcontext())[1])
    monkeypatch.setattr(torch.random, "fork_rng", lambda **kw: contextlib.nullcontext())
    runner = FillRunner()
    runner.register(0, lambda xs: torch.stack(xs) * 2, False, [torch.ones(2) for _ in range(2)])
    slot = FillSlot(chunks=(FillChunk(0, 0, 2, 0.001),), budget_s=10.0)
    (result,) = runner.run_slot(slot, torch.device("cuda", 0), lambda: False)
    assert result.error is None and not result.skipped, result.error
    assert "DEVICE SYNC" not in calls and calls.count("on fill stream") == 1 and "stream sync" in calls
