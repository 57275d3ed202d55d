"""``python -m mpmd bench controller``: what one controller spends per actor and step as the
number of actors grows to thousands, over the step channels (Note [step channel] in
actors/channel.py).

Simulated actors (Note [simulated actors] in benchmarks/sim_actors.py) stand in for N = 16 ..
4,096 actors (``--sizes``): pp = 4 pipeline ranks x dp = N / 4 replicas, 1F1B.  A
``Dispatcher`` drives fed steps over its ``Channels`` as ``fit`` does on a ``ray.data``
dataset (no data from the controller: every actor gets the same bare call, Note [bare calls]
in mpmd/runtime/dispatch.py), one step issued ahead: step k + 1 is issued before step k is
finished.  After warm-up steps, it reads this process's CPU time (``time.process_time``: all
its threads) and the wall time over the measured steps, per step and per actor and step;
the last column is the per-actor CPU as a multiple of the smallest N's (1.00x: the
controller's work per actor does not grow with N).  The simulated actors answer at once, in
helper processes on the same cores, so the wall time is the controller's and theirs.  Each N
runs on its own, after the last is closed: the sizes cannot alternate, since a size's sockets
would raise the others' descriptor numbers (which is what ``select`` cares about); CPU time,
unlike wall time, does not count the time another process held the core.

Beside it, in the same run, real Ray actors at sizes this machine runs (``--ray-sizes``: dp
replicas of a pp = 2 pipeline of tiny stages, 2 to 16 actors), ``fit`` on a small ``ray.data``
dataset (fed steps: the actors pull their rows, the controller only counts steps), the
controller's CPU between the completed steps' records, per actor and step.

Note [one full collection]: the first full (generation 2) garbage collection after the
imports walks every object torch and Ray made, about 120 ms here, once in the process's life.
Falling in a measured window it would triple the first size's per-step CPU; so each size
collects once after its warm-up.  The collector stays on: the steps' own collections count.
"""

from __future__ import annotations

import gc
import math
import time
from typing import NamedTuple, Optional

from .harness import print_table, progress as _progress
from .sim_actors import SimHelpers, losses_per_actor, nofile_hard_limit, raise_nofile, sim_losses

__all__ = ["HELP", "add_arguments", "run", "Measured", "measure_simulated", "measure_ray", "steps_for"]

HELP = "controller CPU per actor and step over the step channels: 16..4,096 simulated actors, 2..16 Ray actors"

SIZES = (16, 64, 256, 1024, 4096)
RAY_DP = (1, 2, 4, 8)
QUICK_SIZES, QUICK_RAY_DP = (16, 64, 256), (1, 2)
SIM_PP, RAY_PP = 4, 2
_FD_SLACK = 256  # the controller's descriptors besides the channels (imports, pipes)
_COMM_TIMEOUT_S = 180.0  # 16 actors forming their groups on 2 busy cores can take over the default 30 s
_IDLE_S = 1.0  # seconds the Ray bench sits idle to measure its background CPU
_ACTOR_STEPS = 32768  # measured steps per N when not given: about this many actor-steps, 20..200 steps


class Measured(NamedTuple):
    """One size's measured steps: totals over ``steps`` steps of ``actors`` actors."""

    actors: int
    steps: int
    cpu_s: float  # this process's CPU, all threads
    wall_s: float
    issue_cpu_s: float = math.nan  # of which issuing (the dispatching thread's), where known
    idle_cpu_per_s: float = math.nan  # this process's CPU per second while no step runs (Ray's threads), where known

    def per_step(self, seconds: float) -> float:
        return seconds / self.steps

    def per_actor(self, seconds: float) -> float:
        return seconds / self.steps / self.actors


def add_arguments(p) -> None:
    p.add_argument("--sizes", type=int, nargs="+", default=None,
                   help=f"simulated actor counts, multiples of pp={SIM_PP} (default: {' '.join(map(str, SIZES))})")
    p.add_argument("--ray-sizes", type=int, nargs="*", default=None,
                   help=f"dp replicas of a pp={RAY_PP} pipeline of real Ray actors (default: "
                        f"{' '.join(map(str, RAY_DP))}; none: skip them)")
    p.add_argument("--microbatches", type=int, default=8, help="microbatches per step (losses the last rank answers)")
    p.add_argument("--steps", type=int, default=None,
                   help=f"measured steps per simulated size (default: about {_ACTOR_STEPS:,} actor-steps, 20..200)")
    p.add_argument("--warmup", type=int, default=5, help="steps before the measured ones")
    p.add_argument("--ray-steps", type=int, default=30, help="measured steps per Ray size")
    p.add_argument("--processes", type=int, default=2, help="helper processes serving the simulated actors")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a step may take before it fails")
    p.add_argument("--quick", action="store_true",
                   help=f"a smoke run: few steps, and unless given, --sizes {' '.join(map(str, QUICK_SIZES))} "
                        f"and --ray-sizes {' '.join(map(str, QUICK_RAY_DP))}")
    p.set_defaults(run=run)


def steps_for(actors: int, steps: Optional[int]) -> int:
    """Measured steps for ``actors`` simulated actors: ``steps`` if given, else about
    ``_ACTOR_STEPS`` actor-steps, within 20..200."""
    return steps if steps is not None else max(20, min(200, _ACTOR_STEPS // actors))


def measure_simulated(helpers: SimHelpers, actors: int, microbatches: int, steps: int, warmup: int, *,
                      timeout_s: float) -> Measured:
    """Fed steps on ``actors`` simulated actors (pp=4), one issued ahead; raises if a reply is
    not the one the actor should have given (the check's CPU is not counted; its wall time is)."""
    from actors.grid import DeviceGrid
    from mpmd.runtime.channels import Channels
    from mpmd.runtime.dispatch import Dispatcher
    from schedules import get_schedule

    grid = DeviceGrid(dp=actors // SIM_PP, pp=SIM_PP, tp=1)
    schedule = get_schedule("1f1b", SIM_PP, microbatches)
    losses = losses_per_actor(grid, schedule, microbatches)
    key = Channels.new_key()
    with helpers.open(losses, key) as sim:
        dispatcher = Dispatcher(sim.handles, schedule, grid, on_failure=lambda: None)
        dispatcher.attach(Channels(sim.addresses, key))
        try:
            def issue(step: int):
                return dispatcher.issue_step("train", step, None, None, relearn=False,
                                             segments=[[(0, -1)]] * SIM_PP)

            pending = issue(0)
            for step in range(1, warmup + 1):
                ahead = issue(step)
                _check_replies(step - 1, dispatcher.finish_step(pending, timeout_s), losses)
                pending = ahead
            gc.collect()  # Note [one full collection]
            issue_cpu, check_cpu = 0.0, 0.0
            c0, w0 = time.process_time(), time.perf_counter()
            for step in range(warmup + 1, warmup + 1 + steps):
                ahead = issue(step)
                issue_cpu += dispatcher.last.cpu_s
                replies = dispatcher.finish_step(pending, timeout_s)
                t = time.process_time()
                _check_replies(step - 1, replies, losses)  # checked, not kept: no survivors for the collector
                check_cpu += time.process_time() - t
                pending = ahead
            cpu, wall = time.process_time() - c0 - check_cpu, time.perf_counter() - w0
            _check_replies(warmup + steps, dispatcher.finish_step(pending, timeout_s), losses)
        finally:
            dispatcher.close()
    return Measured(actors, steps, cpu, wall, issue_cpu)


def _check_replies(step: int, replies: list, losses: list[int]) -> None:
    if len(replies) != len(losses):
        raise RuntimeError(f"step {step}: {len(replies)} replies for {len(losses)} simulated actors")
    for actor, (reply, n) in enumerate(zip(replies, losses)):
        if reply.losses != sim_losses(actor, step, n) or reply.timeline:
            raise RuntimeError(f"step {step}: actor {actor}'s reply is not its own: {reply}")


def measure_ray(dp: int, microbatches: int, steps: int, warmup: int) -> Measured:
    """``fit`` on a ``ray.data`` dataset on ``dp`` replicas of a pp=2 pipeline of tiny stages:
    the controller's CPU and wall time between the warm-up's last completed step and the last."""
    import numpy as np
    import ray.data
    import torch

    import mpmd

    ray.data.DataContext.get_current().enable_progress_bars = False
    torch.manual_seed(0)
    stages = [torch.nn.Linear(8, 8) for _ in range(RAY_PP)]
    batch = microbatches * dp * 2  # 2 rows per microbatch and replica
    rng = np.random.default_rng(0)
    rows = [{"x": rng.standard_normal(8, dtype=np.float32), "y": rng.standard_normal(8, dtype=np.float32)}
            for _ in range((warmup + steps + 1) * batch)]
    marks: list[tuple[float, float]] = []

    def mark(record) -> None:
        if len(marks) == warmup:
            gc.collect()  # Note [one full collection]
        marks.append((time.process_time(), time.perf_counter()))

    actors = RAY_PP * dp
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=microbatches, dp=dp,
                       loss_fn=torch.nn.functional.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                       device="cpu", num_cpus=min(1.0, 2 / actors), comm_timeout_s=_COMM_TIMEOUT_S) as pipe:
        if not pipe.engine.uses_step_channel:
            raise RuntimeError("the step channels did not open; this bench measures steps over them")
        pipe.fit(ray.data.from_items(rows), batch_size=batch, columns=("x", "y"), progress=False,
                 callbacks=[mark])
        if pipe.engine.last_dispatch.bare != actors:
            raise RuntimeError(f"a fed step sent data to some actor ({pipe.engine.last_dispatch}); "
                               f"this bench measures bare calls")
        c, w = time.process_time(), time.perf_counter()
        time.sleep(_IDLE_S)  # what Ray's threads here cost with the pipeline up and no step running
        idle = (time.process_time() - c) / (time.perf_counter() - w)
    if len(marks) < warmup + 2:
        raise RuntimeError(f"fit completed {len(marks)} steps, fewer than the {warmup + 2} measured")
    (c0, w0), (c1, w1) = marks[warmup], marks[-1]
    return Measured(actors, len(marks) - 1 - warmup, c1 - c0, w1 - w0, idle_cpu_per_s=idle)


_START = time.perf_counter()


def progress(msg: str) -> None:
    _progress(f"[bench controller {time.perf_counter() - _START:5.0f}s] {msg}")


def _fits(actors: int, processes: int) -> Optional[str]:
    """Why ``actors`` simulated actors do not fit this machine's descriptor limit, or None."""
    hard = nofile_hard_limit()
    per_helper = math.ceil(actors / processes) + _FD_SLACK
    if actors + _FD_SLACK > hard or per_helper > hard:
        return (f"needs {max(actors, per_helper) + _FD_SLACK:,} open descriptors in one process, over the hard "
                f"limit of {hard:,} (ulimit -Hn); raise the hard limit, or add --processes for the helpers' share")
    return None


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base > 0 else "-"


def run(args) -> int:
    global _START
    _START = time.perf_counter()
    sizes = sorted(set(args.sizes if args.sizes is not None else QUICK_SIZES if args.quick else SIZES))
    ray_dp = sorted(set(args.ray_sizes if args.ray_sizes is not None else QUICK_RAY_DP if args.quick else RAY_DP))
    steps = min(args.steps or 20, 20) if args.quick else args.steps
    warmup = min(args.warmup, 2) if args.quick else args.warmup
    ray_steps = min(args.ray_steps, 8) if args.quick else args.ray_steps
    bad = [n for n in sizes if n < SIM_PP or n % SIM_PP]
    if bad:
        raise SystemExit(f"bench controller: --sizes must be multiples of pp={SIM_PP} (got {bad}); e.g. 16 64 256")
    counts = (args.microbatches, args.processes, args.ray_steps, 1 if args.steps is None else args.steps, *ray_dp)
    if min(counts) < 1 or args.warmup < 0:
        raise SystemExit("bench controller: --ray-sizes, --microbatches, --processes, --steps and --ray-steps must "
                         "be positive, --warmup at least 0")
    too_many = {n: why for n in sizes if (why := _fits(n, args.processes))}
    runnable = [n for n in sizes if n not in too_many]
    if runnable:
        raise_nofile(max(runnable) + _FD_SLACK, "bench controller")

    results: dict[int, object] = {}  # N -> Measured, or why it was not measured
    for n in sizes:
        if n in too_many:
            progress(f"{n} simulated actors: skipped, {too_many[n]}")
            results[n] = f"skipped: {too_many[n]}"
    if runnable:
        progress(f"starting {args.processes} simulated-actor process(es) ...")
        with SimHelpers(args.processes) as helpers:
            for n in runnable:
                progress(f"{n} simulated actors ...")
                try:
                    results[n] = measure_simulated(helpers, n, args.microbatches, steps_for(n, steps), warmup,
                                                   timeout_s=args.timeout)
                except Exception as e:  # noqa: BLE001 - a size the controller cannot drive is a result: said in its row
                    progress(f"{n} simulated actors failed: {type(e).__name__}: {e}")
                    results[n] = f"failed: {type(e).__name__}: {e}"
    results = dict(sorted(results.items()))
    ray_results: dict[int, object] = {}
    if ray_dp:
        ray_results = _run_ray(ray_dp, args.microbatches, ray_steps, warmup)

    print(f"\nController per step over the step channels: fed steps (bare calls), 1f1b, pp={SIM_PP}, "
          f"{args.microbatches} microbatches, one step issued ahead; simulated actors in {args.processes} helper "
          f"process(es); CPU: this process, all threads (time.process_time), mean over the measured steps")
    _print_rows(results, lambda n: f"{SIM_PP} x {n // SIM_PP}", "simulated actors", issue=True)
    if ray_results:
        print(f"\nThe same with real Ray actors: pp={RAY_PP} x dp tiny stages (Linear(8, 8)), fit on a ray.data "
              f"dataset (fed steps), {args.microbatches} microbatches; CPU between completed steps' records; idle: of "
              f"it, what this process burns with no step running (Ray's threads), over the step's wall time")
        _print_rows(ray_results, lambda n: f"{RAY_PP} x {n // RAY_PP}", "Ray actors", issue=False)
        _print_side_by_side(results, ray_results)
    return 0


def _run_ray(dps: list[int], microbatches: int, steps: int, warmup: int) -> dict[int, object]:
    import mpmd

    from .harness import ensure_ray

    ensure_ray(2)  # fractional CPUs: 16 actors fit on two logical CPUs
    got: dict[int, object] = {}
    with mpmd.reuse_actors(max_idle=RAY_PP * max(dps)):  # each size starts only the processes it adds
        for dp in dps:
            progress(f"Ray: pp={RAY_PP} x dp={dp} ...")
            try:
                got[RAY_PP * dp] = measure_ray(dp, microbatches, steps, warmup)
            except Exception as e:  # noqa: BLE001 - said in its row
                progress(f"Ray dp={dp} failed: {type(e).__name__}: {e}")
                got[RAY_PP * dp] = f"failed: {type(e).__name__}: {e}"
    return got


def _print_rows(results: dict, shape, what: str, *, issue: bool) -> None:
    ran = {n: r for n, r in results.items() if isinstance(r, Measured)}
    base_n = min(ran) if ran else None
    base = ran[base_n].per_actor(ran[base_n].cpu_s) if ran else 0.0
    header = ["actors", "pp x dp", "steps", "CPU ms/step", "CPU µs/actor/step"]
    header += ["issue µs/actor"] if issue else ["idle µs/actor"]
    header += ["wall ms/step", "wall µs/actor/step", f"CPU/actor vs {base_n}" if ran else "CPU/actor"]
    rows = []
    for n, r in results.items():
        if not isinstance(r, Measured):
            rows.append([str(n), shape(n)] + ["-"] * (len(header) - 3) + ["not run"])
            continue
        row = [str(n), shape(n), str(r.steps), f"{r.per_step(r.cpu_s) * 1e3:.2f}", f"{r.per_actor(r.cpu_s) * 1e6:.2f}"]
        row += [f"{r.per_actor(r.issue_cpu_s if issue else r.idle_cpu_per_s * r.wall_s) * 1e6:.2f}"]
        row += [f"{r.per_step(r.wall_s) * 1e3:.2f}", f"{r.per_actor(r.wall_s) * 1e6:.2f}",
                _ratio(r.per_actor(r.cpu_s), base)]
        rows.append(row)
    print_table(header, rows)
    if len(ran) >= 2:
        top = max(ran)
        growth = ran[top].per_actor(ran[top].cpu_s) / base
        print(f"Per-actor controller CPU, {what}: {growth:.2f}x from {base_n} to {top} actors "
              f"({top // base_n}x the actors; 1.00x: constant work per actor)")
    for n, r in results.items():
        if not isinstance(r, Measured):
            print(f"Not run, {n} {what}: {r}")


def _print_side_by_side(sim: dict, ray_results: dict) -> None:
    both = sorted(n for n in ray_results if isinstance(ray_results.get(n), Measured)
                  and isinstance(sim.get(n), Measured))
    for n in both:
        s, r = sim[n], ray_results[n]
        print(f"At {n} actors: {r.per_actor(r.cpu_s) * 1e6:.1f} µs of controller CPU per actor and step with Ray "
              f"actors (fit, pp={RAY_PP}) against {s.per_actor(s.cpu_s) * 1e6:.1f} simulated (pp={SIM_PP}): "
              f"{_ratio(r.per_actor(r.cpu_s), s.per_actor(s.cpu_s))}")
