"""Expert all-to-alls in a profile (``ProfileReport.all_to_all``), on a synthetic timeline."""

from __future__ import annotations

import json

import pytest

import mpmd
import schedules
from mpmd.profiler import StepRecord, build_report

from .test_profiler import MS, synthetic


def test_expert_all_to_alls_show_inside_their_compute_slices():
    """Each actor's all-to-all spans become ``A2A`` slices named after the instruction that ran
    them, on a trace track of their own, and their mean time per step is reported per actor;
    the accounting (busy, comm_wait, idle) does not change: they lie inside compute."""
    plain, programs = synthetic(windows=True)
    sched = schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=2)
    records = []
    for rec in _records_of(plain, programs):
        spans = []
        for a, timeline in enumerate(rec.timelines):
            f = next((i, t0, t1) for i, t0, t1 in timeline if programs[a][i].kind.value == "F")
            spans.append(((f[0], f[1] + MS // 4, f[1] + MS // 2, "dispatch"), (f[0], f[1] + MS, f[1] + 7 * MS // 4, "combine")))
        records.append(rec._replace(exchanges=spans))
    report = build_report(schedule=sched, programs=programs, records=records, offsets_ns=[0, 0],
                          memory=[{"peak_rss_bytes": 2**20}] * 2, fusion="step")
    assert report.all_to_all_seconds == pytest.approx((0.001, 0.001))  # 0.25 + 0.75 ms per step
    assert report.busy_seconds == pytest.approx(plain.busy_seconds)
    assert report.idle_seconds == pytest.approx(plain.idle_seconds)
    first_f = [repr(programs[a][next(i for i, ins in enumerate(programs[a]) if ins.kind.value == "F")]) for a in (0, 1)]
    assert sorted({s.name for s in report.all_to_all}) == sorted(f"{n} {w}" for n in first_f for w in ("dispatch", "combine"))
    for s in report.all_to_all:  # inside the compute slice that ran it
        host = next(c for c in report.slices if (c.step, c.actor, c.index) == (s.step, s.actor, s.index))
        assert host.start_ns <= s.start_ns < s.end_ns <= host.end_ns and host.kind == "F"
    trace = json.loads(json.dumps(mpmd.profiler.trace.chrome_trace(report)))
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"r0 expert all-to-all", "r1 expert all-to-all"} <= tracks
    assert "of it all-to-all ms" in report.summary()
    assert "of it all-to-all ms" not in plain.summary()


def _records_of(report, programs):
    """``synthetic``'s step records again (build_report keeps only what it derives)."""
    records = []
    for k, (t0, t1) in enumerate(report.step_windows_ns):
        timelines = [[(s.index, s.start_ns, s.end_ns) for s in report.slices if s.step == k and s.actor == a]
                     for a in range(2)]
        records.append(StepRecord(t0, t1, 0.001, 2, timelines))
    return records
