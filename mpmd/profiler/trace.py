"""Exporting a ``ProfileReport``: Chrome trace-event JSON and a PNG timeline."""

from __future__ import annotations

import json
import os
from typing import Protocol

from .slices import COMM, COMPUTE, DPREDUCE, OPT, Slice


class ProfileReport(Protocol):
    """What the exporters read of a ``report.ProfileReport`` (which imports this module to
    export itself, so this one does not import it back)."""

    schedule: str
    fusion: str
    actor_labels: tuple[str, ...]
    actor_stages: tuple[tuple[int, ...], ...]
    rpcs_per_step: int
    dispatch_seconds_per_step: float
    step_seconds: float
    bubble_fraction: float
    predicted_bubble_fraction: float
    predicted_step_seconds: float
    slices: tuple[Slice, ...]
    step_windows_ns: tuple[tuple[int, int], ...]
    predicted: tuple[tuple[int, str, str, float, float], ...]

    @property
    def num_actors(self) -> int: ...

__all__ = ["chrome_trace", "save_chrome_trace", "plot_timeline"]

_CONTROLLER_PID, _ACTORS_PID = 0, 1

COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#55A868", "W": "#8172B3", "SEND_F": "#E5AE73",
          "SEND_B": "#E5AE73", "RECV_F": "#DD8452", "RECV_B": "#DD8452", "ALLREDUCE": "#C44E52",
          "TIE_REDUCE": "#C44E52", "OPT": "#937860", "ALLGATHER": "#C44E52",
          "DATA": "#8C8C8C"}
_OTHER = "#B0B0B0"


def _category(kind: str) -> str:
    return "compute" if kind in COMPUTE or kind == OPT else "comm" if kind in COMM else "other"


def chrome_trace(report: ProfileReport) -> dict:
    """Trace events: one track (tid) per actor under the "actors" process, slices named
    by their instruction (``1F3``, ``0SEND_F2``), an actor's dp reductions (``1DP_REDUCE``) on
    a track of their own, as the controller's steps and dispatch.  Timestamps are microseconds from the first profiled step."""
    origin = report.step_windows_ns[0][0]
    us = lambda ns: (ns - origin) / 1e3  # noqa: E731
    events: list[dict] = [
        {"name": "process_name", "ph": "M", "pid": _CONTROLLER_PID, "args": {"name": "controller"}},
        {"name": "thread_name", "ph": "M", "pid": _CONTROLLER_PID, "tid": 0, "args": {"name": "controller"}},
        {"name": "process_name", "ph": "M", "pid": _ACTORS_PID, "args": {"name": "actors"}},
    ]
    for a, label in enumerate(report.actor_labels):
        stages = ",".join(map(str, report.actor_stages[a]))
        events.append({"name": "thread_name", "ph": "M", "pid": _ACTORS_PID, "tid": a,
                       "args": {"name": f"{label} (stages {stages})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": _ACTORS_PID, "tid": a,
                       "args": {"sort_index": a}})
    for k, (t0, t1) in enumerate(report.step_windows_ns):
        events.append({"name": f"step {k}", "cat": "step", "ph": "X", "pid": _CONTROLLER_PID, "tid": 0,
                       "ts": us(t0), "dur": (t1 - t0) / 1e3})
    reducing = sorted({s.actor for s in report.slices if s.kind == DPREDUCE})
    for a in reducing:  # a track of its own: the reduction overlaps the actor's instructions
        events.append({"name": "thread_name", "ph": "M", "pid": _ACTORS_PID, "tid": report.num_actors + a,
                       "args": {"name": f"{report.actor_labels[a]} dp reduction"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": _ACTORS_PID, "tid": report.num_actors + a,
                       "args": {"sort_index": report.num_actors + a}})
    exchanging = sorted({s.actor for s in report.all_to_all})
    for a in exchanging:  # a track of its own: an all-to-all lies inside the compute slice that ran it
        tid = 2 * report.num_actors + a
        events.append({"name": "thread_name", "ph": "M", "pid": _ACTORS_PID, "tid": tid,
                       "args": {"name": f"{report.actor_labels[a]} expert all-to-all"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": _ACTORS_PID, "tid": tid,
                       "args": {"sort_index": tid}})
    for s in report.all_to_all:
        events.append({"name": s.name, "cat": "comm", "ph": "X", "pid": _ACTORS_PID, "tid": 2 * report.num_actors + s.actor,
                       "ts": us(s.start_ns), "dur": (s.end_ns - s.start_ns) / 1e3,
                       "args": {"step": s.step, "instruction": s.index}})
    for s in report.slices:
        tid = s.actor + (report.num_actors if s.kind == DPREDUCE else 0)
        events.append({"name": s.name, "cat": _category(s.kind), "ph": "X", "pid": _ACTORS_PID, "tid": tid,
                       "ts": us(s.start_ns), "dur": (s.end_ns - s.start_ns) / 1e3,
                       "args": {"step": s.step, "instruction": s.index}})
    summary = {
        "schedule": report.schedule, "fusion": report.fusion, "step_seconds": report.step_seconds,
        "predicted_step_seconds": report.predicted_step_seconds, "bubble_fraction": report.bubble_fraction,
        "predicted_bubble_fraction": report.predicted_bubble_fraction, "rpcs_per_step": report.rpcs_per_step,
        "dispatch_seconds_per_step": report.dispatch_seconds_per_step,
    }
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": summary}


def save_chrome_trace(report: ProfileReport, path) -> None:
    _make_parent(path)
    with open(path, "w") as f:
        json.dump(chrome_trace(report), f)


def _make_parent(path) -> None:
    parent = os.path.dirname(os.fspath(path))
    if parent:
        os.makedirs(parent, exist_ok=True)


def plot_timeline(report: ProfileReport, path, step: int | str | None = "median") -> None:
    """Measured timeline of one profiled step (``"median"``: the one of median step time;
    ``None``: all of them) above the simulator's timeline from the measured task costs."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError("report.plot needs matplotlib: pip install 'mpmd[viz]' (or pip install matplotlib)") from None
    windows = report.step_windows_ns
    if step == "median":
        order = sorted(range(len(windows)), key=lambda i: windows[i][1] - windows[i][0])
        step = order[(len(order) - 1) // 2]
    if step is None:
        chosen, origin, end = set(range(len(windows))), windows[0][0], windows[-1][1]
    else:
        if not isinstance(step, int) or not -len(windows) <= step < len(windows):
            raise ValueError(f"step must be 'median', None or a profiled step 0..{len(windows) - 1}, got {step!r}")
        k = step % len(windows)
        chosen, (origin, end) = {k}, windows[k]
    ms = lambda ns: (ns - origin) / 1e6  # noqa: E731
    slices = [s for s in report.slices if s.step in chosen and s.kind != DPREDUCE]  # it would hide what it overlaps
    compute = [s for s in slices if s.kind in COMPUTE]
    first = min((s.start_ns for s in compute), default=origin)
    num_ranks = max((r for r, *_ in report.predicted), default=0) + 1
    horizon = max(ms(end), ms(first) + report.predicted_step_seconds * 1e3)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.55 * (report.num_actors + num_ranks)),
                                      sharex=True, gridspec_kw={"height_ratios": [report.num_actors, num_ranks]})
    n = report.num_actors
    for s in slices:
        _bar(top, n - 1 - s.actor, ms(s.start_ns), (s.end_ns - s.start_ns) / 1e6, s.name, s.kind, horizon)
    top.axvline(ms(end) if step is not None else horizon, color="k", linestyle="--", linewidth=0.8)
    top.set_yticks(range(n), [f"{report.actor_labels[a]}" for a in reversed(range(n))])
    what = "all profiled steps" if step is None else f"profiled step {k} ({(end - origin) / 1e6:.1f} ms)"
    top.set_title(f"measured: {report.schedule}, {what}, {report.step_seconds * 1e3:.1f} ms/step mean, "
                  f"bubble {report.bubble_fraction:.3f}, dispatch {report.dispatch_seconds_per_step * 1e3:.2f} ms "
                  f"({report.rpcs_per_step} RPCs)", fontsize=9)
    shift = ms(first)  # the prediction starts where the measured compute starts
    for rank, name, kind, t0, t1 in report.predicted:
        _bar(bottom, num_ranks - 1 - rank, shift + t0 * 1e3, (t1 - t0) * 1e3, name, kind, horizon)
    bottom.set_yticks(range(num_ranks), [f"r{r}" for r in reversed(range(num_ranks))])
    bottom.set_title(f"simulated from measured task costs: makespan {report.predicted_step_seconds * 1e3:.1f} ms, "
                     f"bubble {report.predicted_bubble_fraction:.3f}", fontsize=9)
    bottom.set_xlabel("ms from the start of the step (controller issues the first RPC at 0)")
    bottom.set_xlim(0, horizon * 1.01)
    legend = [Patch(color=COLORS["F"], label="forward F"), Patch(color=COLORS["B"], label="backward B / I"),
              Patch(color=COLORS["W"], label="weight grad W"), Patch(color=COLORS["SEND_F"], label="send"),
              Patch(color=COLORS["RECV_F"], label="receive (wait)"), Patch(color=COLORS["ALLREDUCE"], label="all-reduce"),
              Patch(color=COLORS["OPT"], label="optimizer step"), Patch(color=_OTHER, label="other (free, fill)")]
    fig.legend(handles=legend, loc="lower center", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    _make_parent(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bar(ax, y: int, x: float, width: float, name: str, kind: str, horizon: float) -> None:
    compute = kind in COMPUTE
    height = 0.8 if compute else 0.4
    ax.broken_barh([(x, width)], (y - height / 2, height), facecolors=COLORS.get(kind, _OTHER),
                   edgecolors="white" if compute else "none", linewidth=0.4)
    if compute and width > horizon * 0.006 * len(name):
        ax.text(x + width / 2, y, name, ha="center", va="center", fontsize=6, color="white")
