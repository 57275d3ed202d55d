"""The profiler's report gives the right numbers, and its exports are well-formed.

The accounting is tested as data on synthetic timelines (no Ray): one step small enough
to work out by hand (``HAND_TIMES``), whose busy, comm_wait, idle, makespan, bubble,
measured costs and prediction are checked against literals, and invariants on others.
One module-scoped pipeline on the session Ray then checks a real profile: the same
invariants, the trace, the plot and fusion's RPC count.
"""

from __future__ import annotations

import json

import pytest
from torch.nn import functional as F

import mpmd
import schedules
from actors.protocol import OPTIMIZER_STEP
from mpmd.profiler import COMM, COMPUTE, OPT, ProfileReport, StepRecord, build_report
from mpmd.profiler.split import SETUP
from mpmd.runtime.compile import compile_programs

from tests.models import adamw, make_data, make_stages

MS = 1_000_000  # ns
COLUMNS = ("actor", "stages", "busy ms", "comm_wait ms", "idle ms", "peak memory MiB")


# -- pure accounting on a synthetic timeline -----------------------------------------------------------


def synthetic(offsets=(0, 0), steps=2, windows=False):
    """1F1B on 2 ranks, 2 microbatches; every compute takes 2 ms, every send/recv 1 ms,
    other instructions 0.5 ms, back to back on each rank, inside a 100 ms step.
    ``windows``: each actor's step window is 90 ms from the step's start and every receive
    waited 0.4 ms of its 1 ms (Note [where a step goes])."""
    sched = schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=2)
    programs = compile_programs(schedules.lower(sched))
    records = []
    for k in range(steps):
        base = k * 200 * MS
        timelines, spans, waited = [], [], []
        for r, prog in enumerate(programs):
            t, tl = base + MS, []
            for i, ins in enumerate(prog):
                d = 2 * MS if ins.kind.value in COMPUTE else MS if ins.kind.value in COMM else MS // 2
                tl.append((i, t + offsets[r], t + d + offsets[r]))
                t += d
            timelines.append(tl)
            spans.append((base + offsets[r], base + 90 * MS + offsets[r], 30 * MS, 20 * MS))  # 10 ms own CPU
            waited.append(tuple((i, 4 * MS // 10) for i, ins in enumerate(prog) if ins.kind.value.startswith("RECV")))
        extra = (spans, waited) if windows else ()
        records.append(StepRecord(base, base + 100 * MS, 0.001, 2, timelines, *extra))
    report = build_report(schedule=sched, programs=programs, records=records, offsets_ns=list(offsets),
                          memory=[{"peak_rss_bytes": 2**20}] * 2, fusion="step")
    return report, programs


def test_synthetic_accounting_adds_up():
    report, programs = synthetic()
    assert report.step_seconds == pytest.approx(0.1)
    for a, prog in enumerate(programs):
        kinds = [ins.kind.value for ins in prog]
        assert report.busy_seconds[a] == pytest.approx(0.002 * sum(k in COMPUTE for k in kinds))
        assert report.comm_wait_seconds[a] == pytest.approx(0.001 * sum(k in COMM for k in kinds))
        total = report.busy_seconds[a] + report.comm_wait_seconds[a] + report.idle_seconds[a]
        assert total == pytest.approx(report.step_seconds)
    assert report.tasks_per_step == sum(map(len, programs))
    assert report.dispatch_seconds_per_task == pytest.approx(0.001 / report.tasks_per_step)
    assert len(report.slices) == report.tasks_per_step * report.steps


def test_a_receive_whose_message_waited_costs_its_consumer():
    """A receive that starts after its send ended only copies the message in: that time
    is charged to the consuming task, not counted as link latency."""
    sched = schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=1)
    programs = compile_programs(schedules.lower(sched))
    # rank 0: F0, SEND_F0, RECV_B0, B0; rank 1: RECV_F0, F0, B0, SEND_B0 (FREEs aside)
    times = {(0, "F"): (0, 2), (0, "SEND_F"): (2, 3), (0, "RECV_B"): (3, 14), (0, "B"): (14, 16),
             (1, "RECV_F"): (5, 5.5), (1, "F"): (5.5, 7.5), (1, "B"): (7.5, 9.5), (1, "SEND_B"): (9.5, 10)}
    timelines = []
    for r, prog in enumerate(programs):
        timelines.append([(i, int(times[(r, ins.kind.value)][0] * MS), int(times[(r, ins.kind.value)][1] * MS))
                          for i, ins in enumerate(prog) if (r, ins.kind.value) in times])
    report = build_report(schedule=sched, programs=programs, records=[StepRecord(0, 20 * MS, 0.0, 2, timelines)],
                          offsets_ns=[0, 0], memory=[{}, {}], fusion="step")
    # the median ready receive (0.5 ms) joins every task that consumes a message: stage 1's
    # forward, stage 0's backward (its receive waited, but copying in costs the same)
    assert report.costs.f == pytest.approx((0.003, 0.0025))
    assert report.costs.b == pytest.approx((0.0025, 0.0025))
    # latency: mean of the two receives' tails after both ends were ready (0.5 ms and 4 ms), less 0.5 ms
    assert report.costs.comm == pytest.approx((0.0005 + 0.004) / 2 - 0.0005)


# A step worked out by hand: 1F1B, 2 ranks, 2 microbatches; forwards take 2 ms (stage 0) and
# 3 ms (stage 1), backwards 4 and 5 ms, sends 0.5 ms, FREEs 0.25 ms; each receive ends 0.5 ms
# after its send (or, when the message was already there, 0.25 ms after it starts); optimizer
# steps 1 ms (rank 0) and 6 ms (rank 1).  The controller's step window is 0 .. 28 ms; rank 1's
# clock runs 7 ms ahead.  (start, end) in ms on the controller's clock:
HAND_TIMES = {
    "0F0": (1.0, 3.0), "0SEND_F0": (3.0, 3.5), "0F1": (3.5, 5.5), "0SEND_F1": (5.5, 6.0),
    "0RECV_B0": (6.0, 13.25), "0B0": (13.25, 17.25), "0FREE0": (17.25, 17.5), "0RECV_B1": (17.5, 22.0),
    "0B1": (22.0, 26.0), "0FREE1": (26.0, 26.25), "0OPT": (26.25, 27.25),
    "1RECV_F0": (1.0, 4.0), "1F0": (4.0, 7.0), "1RECV_F1": (7.0, 7.25), "1B0": (7.25, 12.25),
    "1SEND_B0": (12.25, 12.75), "1FREE0": (12.75, 13.0), "1F1": (13.0, 16.0), "1B1": (16.0, 21.0),
    "1SEND_B1": (21.0, 21.5), "1FREE1": (21.5, 21.75), "1OPT": (21.75, 27.75),
}
HAND_OFFSETS_NS = (0, 7 * MS)


def hand_report():
    sched = schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=2)
    programs = compile_programs(schedules.lower(sched))
    ns = lambda ms, r: round(ms * MS) + HAND_OFFSETS_NS[r]  # noqa: E731 - on the actor's clock
    timelines = []
    for r, prog in enumerate(programs):
        assert {repr(ins) for ins in prog} | {f"{r}OPT"} == {k for k in HAND_TIMES if k[0] == str(r)}
        timeline = [(i, ns(HAND_TIMES[repr(ins)][0], r), ns(HAND_TIMES[repr(ins)][1], r)) for i, ins in enumerate(prog)]
        t0, t1 = HAND_TIMES[f"{r}OPT"]
        timelines.append(timeline + [(OPTIMIZER_STEP, ns(t0, r), ns(t1, r))])
    record = StepRecord(0, 28 * MS, 0.002, 2, timelines)
    return build_report(schedule=sched, programs=programs, records=[record], offsets_ns=list(HAND_OFFSETS_NS),
                        memory=[{}, {}], fusion="step")


def test_hand_computed_step_accounting():
    report = hand_report()
    ms = 1e-3
    assert report.step_seconds == pytest.approx(28 * ms)
    # busy: compute + optimizer.  rank 0: F 2+2, B 4+4, OPT 1 = 13;  rank 1: F 3+3, B 5+5, OPT 6 = 22
    assert report.busy_seconds == pytest.approx((13 * ms, 22 * ms), rel=1e-9)
    # comm_wait: sends and receives.  rank 0: 0.5 + 0.5 + 7.25 + 4.5 = 12.75;  rank 1: 3 + 0.25 + 0.5 + 0.5 = 4.25
    assert report.comm_wait_seconds == pytest.approx((12.75 * ms, 4.25 * ms), rel=1e-9)
    # idle, counted as the gaps and FREEs: rank 0: 1 before 0F0 + 0.25 + 0.25 (FREEs) + 0.75 after OPT = 2.25;
    # rank 1: 1 before 1RECV_F0 + 0.25 + 0.25 + 0.25 after OPT = 1.75
    assert report.idle_seconds == pytest.approx((2.25 * ms, 1.75 * ms), rel=1e-9)
    # makespan: the longest first-compute-start to last-compute-end: rank 0 1 .. 26 = 25 (rank 1: 4 .. 21 = 17)
    assert report.makespan_seconds == pytest.approx(25 * ms, rel=1e-9)
    # bubble: 1 - compute of the busiest rank (rank 1: 16) / makespan = 1 - 16/25
    assert report.bubble_fraction == pytest.approx(0.36, rel=1e-9)
    # dispatch: 2 ms over the 20 instructions of both programs
    assert (report.tasks_per_step, report.dispatch_seconds_per_task) == (20, pytest.approx(0.1 * ms))
    assert [s.name for s in report.slices if s.actor == 1][-1] == OPT  # after the program


def test_hand_computed_costs_and_prediction():
    report = hand_report()
    ms = 1e-3
    # The one receive whose message was already there (1RECV_F1: its send ended at 6, it ran 7 .. 7.25)
    # costs 0.25, which joins each task that consumes a message.  Sends are spread over their tasks.
    # f: stage 0: 2 + (0.5 + 0.5) / 2 sends = 2.5;  stage 1: 3 + 0.25 = 3.25
    # b: stage 0: 4 + 0.25 = 4.25;                 stage 1: 5 + (0.5 + 0.5) / 2 = 5.5
    assert report.costs.f == pytest.approx((2.5 * ms, 3.25 * ms), rel=1e-9)
    assert report.costs.b == pytest.approx((4.25 * ms, 5.5 * ms), rel=1e-9)
    assert report.costs.w == (0.0, 0.0)
    # comm: each receive's end after both ends were ready: 4 - 3.5, 7.25 - 7, 13.25 - 12.75, 22 - 21.5
    # -> mean 0.4375, less the 0.25 of a ready receive = 0.1875
    assert report.costs.comm == pytest.approx(0.1875 * ms, rel=1e-9)
    # The schedule with those costs, worked through (c = 0.1875):
    #   r0 F0 0 .. 2.5, F1 2.5 .. 5;  r1 F0 2.5+c = 2.6875 .. 5.9375, B0 .. 11.4375, F1 .. 14.6875, B1 .. 20.1875
    #   r0 B0 11.4375+c = 11.625 .. 15.875, B1 20.1875+c = 20.375 .. 24.625
    # makespan 24.625; busiest rank: r1, 2 x 3.25 + 2 x 5.5 = 17.5 -> bubble 1 - 17.5/24.625 = 57/197
    assert report.predicted_bubble_fraction == pytest.approx(57 / 197, rel=1e-9)
    # predicted step: each rank's last end plus its optimizer step: max(24.625 + 1, 20.1875 + 6) = 26.1875
    assert report.predicted_step_seconds == pytest.approx(26.1875 * ms, rel=1e-9)


def test_clock_offsets_are_removed():
    shifted, _ = synthetic(offsets=(0, 5_000 * MS))
    plain, _ = synthetic()
    assert [s[5:] for s in shifted.slices] == [s[5:] for s in plain.slices]
    assert shifted.idle_seconds == pytest.approx(plain.idle_seconds)


def test_split_adds_up_to_each_actors_window():
    """Note [where a step goes] on the synthetic step: every part worked out by hand, the parts
    sum to the window, own is the window less every slice but FREE's, and its rows add up."""
    report, programs = synthetic(offsets=(0, 5 * MS), windows=True)
    assert len(report.split) == 2
    for a, prog in enumerate(programs):
        kinds = [ins.kind.value for ins in prog]
        part = report.split[a]
        recvs = sum(k.startswith("RECV") for k in kinds)
        assert part.window == pytest.approx(0.090)
        assert part.compute == pytest.approx(0.002 * sum(k in COMPUTE for k in kinds))
        assert part.wait == pytest.approx(0.0004 * recvs)
        assert part.comm == pytest.approx(0.001 * sum(k in COMM for k in kinds) - part.wait)
        assert part.data == part.optimizer == part.fill == 0.0
        assert part.own == pytest.approx(0.090 - part.compute - 0.001 * sum(k in COMM for k in kinds))
        assert part.own >= 0.0 and part.instructions == len(prog)
        assert sum(part[1:8]) == pytest.approx(part.window)
        assert part.own_per_instruction == pytest.approx(part.own / len(prog))
        assert part.own_cpu == pytest.approx(0.010)
    rows = {k.kind: k for k in report.own_by_kind}
    assert rows["FREE"].own_seconds == pytest.approx(0.0005)  # back to back: its slice alone
    assert rows["RECV_F"].wait_seconds == pytest.approx(0.0004) and rows["F"].own_seconds == 0.0
    assert rows[SETUP].count == 2 and rows[SETUP].own_seconds > 0.001  # 1 ms before, the rest after
    assert sum(k.count * k.own_seconds for k in report.own_by_kind) == pytest.approx(sum(p.own for p in report.split))
    assert report.own_per_instruction_seconds == pytest.approx(
        sum(p.own for p in report.split) / sum(len(p) for p in programs))
    text = report.summary()
    assert "where the actors' steps go" in text and "own CPU us/instr" in text and SETUP in text
    assert report.own_cpu_per_instruction_seconds == pytest.approx(0.020 / sum(len(p) for p in programs))
    assert not synthetic()[0].split and "where the actors' steps go" not in synthetic()[0].summary()


def test_build_report_refuses_missing_timelines():
    sched = schedules.get_schedule("1f1b", 2, 2)
    programs = compile_programs(schedules.lower(sched))
    with pytest.raises(ValueError, match="timelines of 1 actors; expected 2"):
        build_report(schedule=sched, programs=programs, records=[StepRecord(0, 1, 0.0, 2, [[]])], offsets_ns=[0, 0],
                     memory=[{}, {}], fusion="step")
    with pytest.raises(ValueError, match="no profiled steps"):
        build_report(schedule=sched, programs=programs, records=[], offsets_ns=[0, 0], memory=[{}, {}], fusion="step")


def test_synthetic_summary_and_trace(tmp_path):
    report, _ = synthetic()
    text = report.summary()
    for column in COLUMNS:
        assert column in text
    path = tmp_path / "sub" / "trace.json"
    report.save_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e["ph"] == "X" and e["pid"] == 1} == {0, 1}


# -- a real profile ------------------------------------------------------------------------------------

STEPS = 2


@pytest.fixture(scope="module")
def pipe(ray_session):
    # interleaved-1f1b on 2 actors: cross-actor sends and same-actor hand-offs both occur.
    with mpmd.Pipeline(make_stages(4), schedule="interleaved-1f1b", num_microbatches=4, loss_fn=F.mse_loss,
                       optimizer=adamw, num_actors=2, device="cpu", fusion="step") as p:
        yield p


@pytest.fixture(scope="module")
def report(pipe) -> ProfileReport:
    x, y = make_data(1, 8)[0]
    return pipe.profile(x, y, steps=STEPS)


def test_report_accounts_every_actor(report):
    assert report.num_actors == 2 and report.steps == STEPS
    assert report.clock_offsets_ns == (0, 0)  # one node: one clock
    by_actor_step: dict = {}
    for s in report.slices:
        by_actor_step.setdefault((s.actor, s.step), []).append(s)
    for (a, k), slices in by_actor_step.items():
        t0, t1 = report.step_windows_ns[k]
        slices.sort(key=lambda s: s.start_ns)
        assert t0 <= slices[0].start_ns and slices[-1].end_ns <= t1, "an instruction lies outside its step"
        assert all(p.end_ns <= q.start_ns for p, q in zip(slices, slices[1:])), "instructions overlap"
    for a in range(report.num_actors):
        total = report.busy_seconds[a] + report.comm_wait_seconds[a] + report.idle_seconds[a]
        assert total == pytest.approx(report.step_seconds, rel=1e-9)
        assert report.busy_seconds[a] > 0 and report.comm_wait_seconds[a] > 0 and report.idle_seconds[a] >= 0
        busy = sum(s.seconds for s in report.slices if s.actor == a and s.kind in COMPUTE | {OPT}) / STEPS
        assert report.busy_seconds[a] == pytest.approx(busy)
        assert report.peak_memory_bytes[a] > 0
    assert 0.0 <= report.bubble_fraction < 1.0 and 0.0 <= report.predicted_bubble_fraction < 1.0
    assert report.makespan_seconds <= report.step_seconds
    assert report.predicted_step_seconds > 0
    # Each stage's gradient bytes (float32 weights and biases): with dp > 1 the all-reduce's fit needs them.
    assert report.calibrated_costs.grad_bytes == tuple(sum(p.numel() * 4 for p in m.parameters()) for m in make_stages(4))


def test_report_splits_each_actors_window(pipe, report):
    """Note [where a step goes]: each actor's window is its parts' sum, own is not negative,
    every program instruction counts, the kinds' rows add up to own, the summary prints it."""
    programs = pipe.engine.program("train")
    assert len(report.split) == report.num_actors
    for a, part in enumerate(report.split):
        assert all(v >= 0.0 for v in part), part
        assert sum(part[1:8]) == pytest.approx(part.window, rel=1e-9)
        assert 0 < part.window <= report.step_seconds
        assert part.compute > 0 and part.comm > 0 and part.optimizer > 0
        assert part.instructions == len(programs[a])
    assert sum(k.count * k.own_seconds for k in report.own_by_kind) == pytest.approx(sum(p.own for p in report.split))
    assert report.own_per_instruction_seconds > 0 and report.own_cpu_per_instruction_seconds > 0
    assert all(part.own_cpu <= part.window for part in report.split)
    assert "own us/instr" in report.summary()


def test_step_fusion_issues_one_rpc_per_actor(pipe, report):
    assert report.rpcs_per_step == len(pipe.actors)
    assert report.tasks_per_step == sum(len(p) for p in pipe.engine.program("train"))
    assert report.dispatch_seconds_per_step > 0


def test_chrome_trace_has_a_track_per_actor_and_every_instruction(pipe, report, tmp_path):
    path = tmp_path / "trace.json"
    report.save_chrome_trace(path)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == 1]
    assert {e["tid"] for e in slices} == set(range(len(pipe.actors)))
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"]
             if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == 1}
    assert set(names) == set(range(len(pipe.actors)))
    # every instruction, and each actor's sends awaited and optimizer step
    assert len(slices) == (sum(len(p) for p in pipe.engine.program("train")) + 2 * len(pipe.actors)) * STEPS
    flushes = sum(e["name"] == "FLUSH" for e in slices)
    assert sum(e["name"] == OPT for e in slices) == flushes == len(pipe.actors) * STEPS
    for e in slices:
        if e["name"] not in (OPT, "FLUSH"):
            assert repr(schedules.Action.parse(e["name"])) == e["name"]  # "1F3", "0SEND_F2", ...
        assert e["ts"] >= 0 and e["dur"] >= 0


def test_summary_names_its_columns(report):
    text = report.summary()
    for column in COLUMNS:
        assert column in text
    assert "bubble fraction" in text and "RPCs/step" in text and str(report) == text


def test_plot_writes_a_png(report, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "timeline.png"
    report.plot(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report.plot(tmp_path / "first.png", step=0)
    with pytest.raises(ValueError, match=r"step must be 'median', None or a profiled step 0\.\.1, got 2"):
        report.plot(tmp_path / "bad.png", step=STEPS)


def test_plot_without_matplotlib_says_how_to_install(report, tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(ImportError, match=r"pip install 'mpmd\[viz\]'"):
        report.plot(tmp_path / "timeline.png")


def test_profile_validates_steps(pipe):
    x, y = make_data(1, 8)[0]
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        pipe.profile(x, y, steps=0)


def test_bench_measures_every_fusion_mode_on_one_set_of_actors(pipe):
    from benchmarks.bench import measure_mpmd

    data = make_data(2, 8)
    result = measure_mpmd(pipe, data, warmup=0, steps=1)
    tasks = sum(len(p) for p in pipe.engine.program("train"))
    assert result["step"]["rpcs"] == result["step-ray"]["rpcs"] == [len(pipe.actors)]
    assert result["none"]["rpcs"] == [tasks]
    assert len(pipe.actors) < result["consecutive"]["rpcs"][0] < tasks
    assert pipe.config.dispatch.fusion == "step" and pipe.engine.uses_step_channel  # restored
