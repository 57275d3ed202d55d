"""A ``ProfileReport``: where a training step's time goes, measured against the schedule.

A profiled step (``run.py``) is an ordinary training step whose actors also record the
start and end of every instruction (``time.time_ns()``).  The controller aligns the
actors' clocks with its own; ``build_report`` (pure: no Ray) accounts each actor's share
of the step:

* ``busy``: compute instructions (``F``, ``B``, ``I``, ``W``) and the optimizer step
  (an ``OPT`` slice at the end of a training step);
* ``comm_wait``: ``SEND_*``, ``RECV_*``, ``ALLREDUCE``, ``TIE_REDUCE`` and the sends awaited
  after the program (``FLUSH``) (for a receive this is mostly waiting for the peer; a send
  only posts the message);
* ``idle``: the rest of the step as the controller saw it, from issuing the first
  RPC to holding every result: bubbles, dispatch and RPC latency, the optimizer
  step, buffer frees.  ``busy + comm_wait + idle == step_seconds`` per actor.  A
  stage's dp reduction started inside its last backward (a ``DP_REDUCE`` slice, Note
  [overlapped dp reduction]) overlaps those and counts in none; its wait is the ``ALLREDUCE``.

The measured mean task costs (per stage ``f``, ``b``, ``w`` and a point-to-point
``comm`` latency) are fed to ``schedules.simulate`` to predict the step time and
bubble the schedule alone would give (see docs/profiling.md), with each rank's measured
optimizer step after its last task (``Costs.optimizer``).  The calibrated cost model
(``calibrate.py``: per-task and per-message costs, transfers, prefetched receives, the
step's own overhead) simulates the lowered program instruction by instruction for
``calibrated_step_seconds``.

The actors' side of the step, their step windows split into compute, waiting on a peer,
communication work, data, the optimizer and their own overhead, is ``split`` and
``own_by_kind`` (``split.py``, Note [where a step goes]).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import NamedTuple, Sequence

import schedules
from actors.protocol import ALL_GATHER, DP_REDUCE, FEED, FLUSH, OPTIMIZER_STEP, dp_reduce_position
from schedules import Costs, Schedule

from . import trace
from .calibrate import calibrated_costs, lowered_from_programs, stage_task_costs
from .exchanges import A2AHiding, exchange_slices, hiding_lines
from .slices import ALLGATHER, COMM, COMPUTE, DATA, DPREDUCE, FLUSHED, OPT, Slice
from .split import ActorSplit, KindOwn, split_steps

__all__ = ["ProfileReport", "StepRecord", "build_report", "measured_costs", "format_table"]


class StepRecord(NamedTuple):
    """What the controller saw of one profiled step (its own clock)."""

    start_ns: int
    end_ns: int
    dispatch_s: float
    rpcs: int
    timelines: list  # per actor: [(instruction index, start_ns, end_ns)] on the actor's clock
    windows: list = ()  # per actor: StepReply.window, its step window on its clock (Note [where a step goes])
    waited: list = ()  # per actor: ((instruction index, ns blocked waiting for a peer), ...)
    exchanges: list = ()  # per actor: StepReply.exchanges, its expert all-to-alls on its clock


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProfileReport:
    """Measured dispatch overhead, per-actor time accounting, bubble and timeline.

    Times are seconds per step, means over the profiled steps; per-actor tuples are in
    ``actor_labels`` order (rank order, replica-major with dp).
    """

    schedule: str
    fusion: str
    num_microbatches: int
    steps: int
    actor_labels: tuple[str, ...]
    actor_stages: tuple[tuple[int, ...], ...]
    rpcs_per_step: int
    tasks_per_step: int  # program instructions over all actors (what fusion="none" sends one RPC each)
    dispatch_seconds_per_step: float
    dispatch_seconds_per_task: float
    step_seconds: float  # controller wall time: first RPC issued to every result back
    step_seconds_each: tuple[float, ...]
    makespan_seconds: float  # first compute start to last compute end (the simulator's makespan)
    busy_seconds: tuple[float, ...]
    comm_wait_seconds: tuple[float, ...]
    idle_seconds: tuple[float, ...]
    bubble_fraction: float  # 1 - busy(busiest actor) / makespan, as the simulator defines it
    predicted_bubble_fraction: float
    predicted_step_seconds: float  # simulated makespan from the measured task costs
    costs: Costs  # measured mean task costs per stage (seconds)
    peak_memory_bytes: tuple[int, ...]  # peak RSS of each actor process
    device_peak_memory_bytes: tuple[int, ...]  # peak allocated CUDA memory (0 on CPU)
    clock_offsets_ns: tuple[int, ...]  # subtracted from each actor's clock
    slices: tuple[Slice, ...]
    step_windows_ns: tuple[tuple[int, int], ...]  # controller clock
    predicted: tuple[tuple[int, str, str, float, float], ...]  # (rank, name, kind, start_s, end_s)
    calibrated_costs: Costs = Costs()  # the runtime terms too (calibrate.py)
    calibrated_step_seconds: float = 0.0  # the lowered program simulated under calibrated_costs
    calibrated_bubble_fraction: float = 0.0
    # per actor, the bytes it holds of parameters, of gradients kept past the data-parallel
    # reduction and of optimizer state (zero=1 splits the last two over the replicas)
    param_bytes: tuple[int, ...] = ()
    grad_bytes: tuple[int, ...] = ()
    optimizer_bytes: tuple[int, ...] = ()
    data_seconds: tuple[float, ...] = ()  # per actor, a fed step's batch read (or received) before its program
    # Note [where a step goes] in split.py: per actor, its step window split into compute, wait,
    # comm, data, optimizer, fill and its own overhead; per instruction kind, the own time before it.
    split: tuple[ActorSplit, ...] = ()
    own_by_kind: tuple[KindOwn, ...] = ()
    # Expert all-to-alls (Note [expert parallelism] in actors/experts.py), each a slice of kind
    # ``A2A`` named after the instruction that ran it and the exchange (``"1F3 dispatch"``); they
    # lie inside their compute slices, so they are no share of their own in the accounting above.
    # Per actor, their mean seconds per step.
    all_to_all: tuple[Slice, ...] = ()
    all_to_all_seconds: tuple[float, ...] = ()
    all_to_all_hiding: tuple[A2AHiding, ...] = ()  # per actor and step: in flight, blocked, hidden (exchanges.py)

    @property
    def calibrated_ratio(self) -> float:
        """Measured step time over the calibrated cost model's prediction."""
        return self.step_seconds / self.calibrated_step_seconds if self.calibrated_step_seconds > 0 else float("nan")

    # -- derived -------------------------------------------------------------------------------
    @property
    def num_actors(self) -> int:
        return len(self.actor_labels)

    @property
    def dispatch_fraction(self) -> float:
        """Controller dispatch time as a fraction of the step."""
        return self.dispatch_seconds_per_step / self.step_seconds if self.step_seconds > 0 else 0.0

    @property
    def own_per_instruction_seconds(self) -> float:
        """The actors' own overhead over the instructions they ran (Note [where a step goes])."""
        n = sum(a.instructions for a in self.split)
        return sum(a.own for a in self.split) / n if n else float("nan")

    @property
    def own_cpu_per_instruction_seconds(self) -> float:
        """The CPU time of the actors' own overhead over the instructions they ran (Note [where a step goes])."""
        n = sum(a.instructions for a in self.split)
        return sum(a.own_cpu for a in self.split) / n if n else float("nan")

    @property
    def prediction_ratio(self) -> float:
        """Measured step time over the simulator's prediction (1.0: the schedule explains it all)."""
        return self.step_seconds / self.predicted_step_seconds if self.predicted_step_seconds > 0 else float("nan")

    def summary(self) -> str:
        """The report as a text table (``print(report.summary())``)."""
        ms = 1e3
        c = self.costs
        lines = [
            f"profile: {self.schedule}, {self.num_actors} actors, {self.num_microbatches} microbatches, "
            f"fusion={self.fusion}, {self.steps} steps",
            f"step time        {self.step_seconds * ms:9.2f} ms  (min {min(self.step_seconds_each) * ms:.2f}, "
            f"max {max(self.step_seconds_each) * ms:.2f})",
            f"predicted        {self.predicted_step_seconds * ms:9.2f} ms  (simulator, measured task costs; "
            f"measured / predicted = {self.prediction_ratio:.3f})",
            f"calibrated       {self.calibrated_step_seconds * ms:9.2f} ms  (runtime costs too; measured / "
            f"calibrated = {self.calibrated_ratio:.3f}, bubble {self.calibrated_bubble_fraction:.3f})",
            f"compute span     {self.makespan_seconds * ms:9.2f} ms  (first compute start to last compute end)",
            f"bubble fraction  {self.bubble_fraction:9.3f}     (predicted {self.predicted_bubble_fraction:.3f})",
            f"dispatch         {self.dispatch_seconds_per_step * ms:9.3f} ms/step  ({self.dispatch_fraction:.2%} "
            f"of the step), {self.rpcs_per_step} RPCs/step, {self.dispatch_seconds_per_task * 1e6:.2f} us/task "
            f"over {self.tasks_per_step} tasks",
            "task costs (ms)  " + "  ".join(f"{name} [{', '.join(f'{v * ms:.3f}' for v in c.values(name))}]"
                                            for name in ("f", "b", "w")) + f"  comm {c.comm * ms:.3f}",
            "",
        ]
        fed = any(self.data_seconds)  # the actors read their batches (Note [fed steps])
        experts = any(self.all_to_all_seconds)  # expert all-to-alls, inside busy
        header = ("actor", "stages", "busy ms") + (("of it all-to-all ms",) if experts else ()) + (
            "comm_wait ms",) + (("data ms",) if fed else ()) + (
            "idle ms", "busy %", "peak memory MiB", "params/grads/optimizer MiB")
        rows = []
        for i, label in enumerate(self.actor_labels):
            mem = self.device_peak_memory_bytes[i] or self.peak_memory_bytes[i]
            rows.append((label, ",".join(map(str, self.actor_stages[i])), f"{self.busy_seconds[i] * ms:.2f}")
                        + ((f"{self.all_to_all_seconds[i] * ms:.2f}",) if experts else ())
                        + (f"{self.comm_wait_seconds[i] * ms:.2f}",)
                        + ((f"{self.data_seconds[i] * ms:.2f}",) if fed else ()) + (f"{self.idle_seconds[i] * ms:.2f}",
                         f"{self.busy_seconds[i] / self.step_seconds:.1%}" if self.step_seconds else "-",
                         f"{mem / 2**20:.1f}", "/".join(f"{b[i] / 2**20:.2f}" if len(b) > i else "-" for b in
                                                        (self.param_bytes, self.grad_bytes, self.optimizer_bytes))))
        lines += format_table(header, rows)
        if self.split:
            lines += [""] + self.split_lines()
        return "\n".join(lines + hiding_lines(self.all_to_all_hiding, self.actor_labels, format_table))

    def split_lines(self) -> list[str]:
        """Where each actor's step goes, and the own time per instruction kind (Note [where a step goes])."""
        ms, us = 1e3, 1e6
        header = ("actor", "window ms", "compute", "wait", "comm", "data", "optimizer", "fill", "own",
                  "instructions", "own us/instr", "own CPU us/instr")
        rows = [(label, f"{a.window * ms:.3f}") + tuple(f"{v * ms:.3f}" for v in a[1:8])
                + (f"{a.instructions:.0f}", f"{a.own_per_instruction * us:.1f}",
                   f"{a.own_cpu_per_instruction * us:.1f}")
                for label, a in zip(self.actor_labels, self.split)]
        kinds = [(k.kind, f"{k.count:.1f}", f"{k.slice_seconds * us:.1f}", f"{k.wait_seconds * us:.1f}",
                  f"{k.own_seconds * us:.1f}", f"{k.count * k.own_seconds * ms:.3f}") for k in self.own_by_kind]
        return ([f"where the actors' steps go (ms per step; own = the step window less every recorded slice): "
                 f"own {self.own_per_instruction_seconds * us:.1f} us per instruction, of it "
                 f"{self.own_cpu_per_instruction_seconds * us:.1f} us on the CPU"]
                + format_table(header, rows) + [""]
                + format_table(("kind", "per step", "slice us", "of it wait us", "own before us", "own ms/step"),
                               kinds))

    def __str__(self) -> str:
        return self.summary()

    def save_chrome_trace(self, path) -> None:
        """Write Chrome trace-event JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
        trace.save_chrome_trace(self, path)

    def plot(self, path, step: int | str | None = "median") -> None:
        """Save a PNG timeline of one profiled step (by default the one of median step time;
        ``None``: all of them) above the simulator's timeline from the measured costs.
        Needs matplotlib (``pip install 'mpmd[viz]'``)."""
        trace.plot_timeline(self, path, step)


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = lambda row: "  ".join(str(x).rjust(w) if j else str(x).ljust(w)  # noqa: E731
                                for j, (x, w) in enumerate(zip(row, widths)))
    return [fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]


# -- analysis (pure: no Ray) ---------------------------------------------------------------------------
def build_report(*, schedule: Schedule, programs: list, records: Sequence[StepRecord], offsets_ns: Sequence[int],
                 memory: Sequence[dict], fusion: str, dp: int = 1,
                 activation_bytes: float | Sequence[float] = 0.0,
                 grad_bytes: float | Sequence[float] = 0.0, zero: int = 0) -> ProfileReport:
    """Turn raw step records into a ``ProfileReport``; ``programs[rank]`` lists ``actors.program.Instr``;
    ``activation_bytes``: per stage, the bytes of its output (for the calibrated transfers);
    ``grad_bytes``: per stage, the bytes of its gradients (for the calibrated all-reduce, dp > 1);
    ``zero``: the pipeline's (ZeRO-1 calibrates a reduce-scatter and an all-gather)."""
    num_ranks = schedule.num_ranks
    num_actors = num_ranks * dp
    if not records:
        raise ValueError("no profiled steps to report on")
    slices = []
    for k, rec in enumerate(records):
        if len(rec.timelines) != num_actors:
            raise ValueError(f"step {k} has timelines of {len(rec.timelines)} actors; expected {num_actors}")
        for a, timeline in enumerate(rec.timelines):
            prog = programs[a % num_ranks]
            waited = dict(rec.waited[a]) if rec.waited else {}
            for idx, t0, t1 in timeline:
                if idx in (OPTIMIZER_STEP, ALL_GATHER, FEED, FLUSH):
                    kind = {OPTIMIZER_STEP: OPT, ALL_GATHER: ALLGATHER, FEED: DATA, FLUSH: FLUSHED}[idx]
                    slices.append(Slice(a, k, idx, kind, kind, t0 - offsets_ns[a], t1 - offsets_ns[a],
                                        waited.get(idx, 0)))
                    continue
                if idx <= DP_REDUCE:  # a stage's overlapped dp reduction (Note [overlapped dp reduction])
                    name = f"{prog[dp_reduce_position(idx)].stage}{DPREDUCE}"
                    slices.append(Slice(a, k, idx, name, DPREDUCE, t0 - offsets_ns[a], t1 - offsets_ns[a]))
                    continue
                ins = prog[idx]
                slices.append(Slice(a, k, idx, repr(ins), ins.kind.value, t0 - offsets_ns[a], t1 - offsets_ns[a],
                                    waited.get(idx, 0)))
    exchanges, hiding = exchange_slices(records, programs, num_ranks, offsets_ns)
    by_step_actor: dict[tuple[int, int], list[Slice]] = defaultdict(list)
    for s in slices:
        by_step_actor[(s.step, s.actor)].append(s)

    steps = len(records)
    walls = [(r.end_ns - r.start_ns) * 1e-9 for r in records]
    busy = [[0.0] * num_actors for _ in range(steps)]
    comm = [[0.0] * num_actors for _ in range(steps)]
    opt = [[0.0] * num_actors for _ in range(steps)]
    data = [[0.0] * num_actors for _ in range(steps)]
    spans, bubbles = [], []
    for k in range(steps):
        first, last = [], []
        for a in range(num_actors):
            for s in by_step_actor[(k, a)]:
                if s.kind in COMPUTE:
                    busy[k][a] += s.seconds
                elif s.kind == OPT:
                    opt[k][a] += s.seconds
                elif s.kind in COMM:
                    comm[k][a] += s.seconds
                elif s.kind == DATA:
                    data[k][a] += s.seconds
            compute = [s for s in by_step_actor[(k, a)] if s.kind in COMPUTE]
            if compute:
                first.append(min(s.start_ns for s in compute))
                last.append(max(s.end_ns for s in compute))
        span = max((l - f for f, l in zip(first, last)), default=0) * 1e-9
        spans.append(span)
        bubbles.append(1.0 - max(busy[k]) / span if span > 0 else 0.0)

    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    busy_s = tuple(mean([busy[k][a] + opt[k][a] for k in range(steps)]) for a in range(num_actors))
    opt_s = [mean([opt[k][a] for k in range(steps)]) for a in range(num_actors)]
    comm_s = tuple(mean([comm[k][a] for k in range(steps)]) for a in range(num_actors))
    data_s = tuple(mean([data[k][a] for k in range(steps)]) for a in range(num_actors))
    step_s = mean(walls)
    costs = measured_costs(schedule, slices, programs, num_ranks)
    # Each rank's optimizer step follows its last task (the slowest replica's); the step ends with the last.
    opt_rank = [max(opt_s[a] for a in range(r, num_actors, num_ranks)) for r in range(num_ranks)]
    sim = schedules.simulate(schedule, dataclasses.replace(costs, optimizer=tuple(opt_rank)))
    predicted_step = sim.step_time
    windows = tuple((r.start_ns, r.end_ns) for r in records)
    split, own_by_kind = split_steps(slices, {(k, a): (w[0] - offsets_ns[a], w[1] - offsets_ns[a], *w[2:])
                                              for k, r in enumerate(records) for a, w in enumerate(r.windows) if w},
                                     num_actors, steps)
    fitted = calibrated_costs(schedule, programs, slices, windows, activation_bytes, grad_bytes, zero, exchanges)
    fitted_sim = schedules.simulate(lowered_from_programs(schedule, programs), fitted)
    tasks = sum(len(programs[a % num_ranks]) for a in range(num_actors))
    dispatch = mean([r.dispatch_s for r in records])
    labels = tuple(f"r{a % num_ranks}" + (f"/d{a // num_ranks}" if dp > 1 else "") for a in range(num_actors))
    predicted = tuple(sorted(
        (schedule.stage_to_rank[act.stage], repr(act), act.kind.value, sim.start[act], sim.end[act])
        for act in sim.start))
    return ProfileReport(
        schedule=schedule.name, fusion=fusion, num_microbatches=schedule.num_microbatches, steps=steps,
        actor_labels=labels, actor_stages=tuple(schedule.stages_of(a % num_ranks) for a in range(num_actors)),
        rpcs_per_step=round(mean([r.rpcs for r in records])), tasks_per_step=tasks,
        dispatch_seconds_per_step=dispatch, dispatch_seconds_per_task=dispatch / max(tasks, 1),
        step_seconds=step_s, step_seconds_each=tuple(walls), makespan_seconds=mean(spans),
        busy_seconds=busy_s, comm_wait_seconds=comm_s,
        idle_seconds=tuple(step_s - b - c - d for b, c, d in zip(busy_s, comm_s, data_s)), data_seconds=data_s,
        bubble_fraction=mean(bubbles), predicted_bubble_fraction=sim.bubble_fraction,
        predicted_step_seconds=predicted_step, costs=costs,
        peak_memory_bytes=tuple(int(m.get("peak_rss_bytes", 0)) for m in memory),
        device_peak_memory_bytes=tuple(int(m.get("device_peak_bytes", 0)) for m in memory),
        param_bytes=tuple(int(m.get("params_bytes", 0)) for m in memory),
        grad_bytes=tuple(int(m.get("grads_bytes", 0)) for m in memory),
        optimizer_bytes=tuple(int(m.get("optimizer_bytes", 0)) for m in memory),
        clock_offsets_ns=tuple(offsets_ns), slices=tuple(slices),
        step_windows_ns=windows, predicted=predicted, calibrated_costs=fitted,
        calibrated_step_seconds=fitted_sim.step_time, calibrated_bubble_fraction=fitted_sim.bubble_fraction,
        split=split, own_by_kind=own_by_kind, all_to_all=exchanges, all_to_all_hiding=hiding,
        all_to_all_seconds=tuple(sum(e.seconds for e in exchanges if e.actor == a) / steps for a in range(num_actors)))


def measured_costs(schedule: Schedule, slices: Sequence[Slice], programs: list, num_ranks: int) -> Costs:
    """Mean per-stage task costs for the simulator.

    ``f`` is a forward plus the posting of its activation send, ``b`` a backward (``B``,
    or ``I`` of a split backward) plus its gradient send, ``w`` the ``W`` part (0 for a
    fused ``B``).  A receive costs its rank time even when the message is already there
    (copying it in, waking up): that cost, the median receive whose send had ended before
    it started, joins the task that consumes the message.  ``comm`` is the mean, over
    matched send/receive pairs, of how long the receive ended after both ends were ready
    (send posted and receive started), less that cost.
    """
    total: dict[tuple[str, int], float] = defaultdict(float)
    count: dict[tuple[str, int], int] = defaultdict(int)
    sends: dict[tuple, Slice] = {}
    recvs: list[tuple[tuple, Slice]] = []
    for s in slices:
        if s.index < 0:  # the optimizer step, ZeRO-1's all-gather, a fed step's batch, a dp reduction
            continue
        ins = programs[s.actor % num_ranks][s.index]
        replica = s.actor // num_ranks
        key = (s.kind, ins.stage)
        total[key] += s.seconds
        count[key] += 1
        if s.kind in ("SEND_F", "SEND_B"):
            sends[(s.step, replica, s.kind, ins.stage, ins.microbatch)] = s
        elif s.kind == "RECV_F":  # RECV_F(s, m) receives SEND_F(s - 1, m)
            recvs.append(((s.step, replica, "SEND_F", ins.stage - 1, ins.microbatch), s))
        elif s.kind == "RECV_B":  # RECV_B(s, m) receives SEND_B(s + 1, m)
            recvs.append(((s.step, replica, "SEND_B", ins.stage + 1, ins.microbatch), s))

    def per_task(send_kind: str, task_kinds: tuple[str, ...], stage: int) -> float:
        tasks = sum(count[(k, stage)] for k in task_kinds)
        return total[(send_kind, stage)] / tasks if tasks else 0.0

    lat, ready = [], []
    for key, r in recvs:
        snd = sends.get(key)
        if snd is not None:
            lat.append(max(0, r.end_ns - max(snd.end_ns, r.start_ns)) * 1e-9)
            if snd.end_ns <= r.start_ns:
                ready.append(r.seconds)
    receive = sorted(ready)[len(ready) // 2] if ready else 0.0
    f, b, w, fused = stage_task_costs(
        schedule, lambda kind, st: total[(kind, st)] / count[(kind, st)] if count[(kind, st)] else None,
        around_f=lambda st: per_task("SEND_F", ("F",), st) + receive * (count[("RECV_F", st)] > 0),
        around_b=lambda st: per_task("SEND_B", ("I", "B"), st) + receive * (count[("RECV_B", st)] > 0))
    comm = max(0.0, sum(lat) / len(lat) - receive) if lat else 0.0
    return Costs(f=f, b=b, w=w, fused=fused, comm=comm)
