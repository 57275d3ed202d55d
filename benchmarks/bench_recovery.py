"""``python -m mpmd bench recovery``: how long training stops when an actor dies during
``fit(..., max_restarts=...)``, and where that time goes.

A 1F1B pipeline (``--actors`` stages; each forward sleeps ``--stage-ms`` so a step lasts
long enough to be killed in the middle of) trains ``--steps`` steps with a checkpoint every
``--every`` (``--async`` for asynchronous ones).  One actor (rank 1) is killed with
``ray.kill``, once per mode:

- ``between``: from the data iterator, after the actors finished the previous step (the
  iterator waits twice a step's time first), before the next batch reaches ``fit``;
- ``mid-step``: from a thread, half a step after the previous step completed, while the
  next one (already in flight, Note [one step in flight]) runs.

Printed per mode, seconds from the kill: **detection** (until ``fit`` catches the
``ActorDiedError`` and starts the restart), **new actors** (old ones torn down, fresh ones
placed, communication groups formed, modules and programs shipped), **checkpoint load**
(the last complete checkpoint into the new actors), **replay** (the batches since that
checkpoint and the interrupted one run again), **total** (until the first step beyond the
last one completed before the kill).  Then the run is checked against an uninterrupted
one: losses and every parameter bit for bit.  Warm-up: each run starts with its own
pipeline (a fresh set of actors) and trains ``--kill-at`` steps before the kill.

``--spares``: each mode runs again with ``spare_actors`` = the actor count (Note [spare
actors] in mpmd/runtime/spares.py), the spares answering a call before training starts
(warm), so "new actors" is what remains once no process has to start.
"""

from __future__ import annotations

import tempfile
import threading
import time
from typing import Callable

import torch

from mpmd.pipeline import Pipeline
from mpmd.runtime import Fleet
from mpmd.training.fit_checkpoints import FitCheckpoints
from .harness import ensure_ray, print_table

__all__ = ["HELP", "add_arguments", "run", "SleepyLinear", "measure_recovery"]

HELP = "seconds from an actor's death to the next completed step, by phase"

MODES = ("between", "mid-step")


class SleepyLinear(torch.nn.Module):
    """A linear layer whose forward also sleeps (a stand-in for compute that takes time)."""

    def __init__(self, width: int, sleep_s: float) -> None:
        super().__init__()
        self.lin, self.sleep_s = torch.nn.Linear(width, width), sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.sleep_s)
        return torch.tanh(self.lin(x))


def add_arguments(p) -> None:
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=6, help="checkpoint every this many steps")
    p.add_argument("--kill-at", type=int, default=15, help="the step before which (or during which) rank 1 dies")
    p.add_argument("--stage-ms", type=float, default=5.0, help="sleep per stage forward (a step's length)")
    p.add_argument("--async", dest="asynchronous", action="store_true", help="asynchronous checkpoints")
    p.add_argument("--spares", action="store_true", help="each mode also with warm spare actors (spare_actors)")
    p.set_defaults(run=run)


class _Clock:
    """Timestamps of the restart's phases, taken by wrapping the methods fit calls."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.completed: list[tuple[float, int]] = []  # (time, step) of every completed step

    def wrap(self, owner: type, name: str, before: str, after: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(obj, *args, **kwargs):
            self.marks.setdefault(before, time.perf_counter())
            try:
                return original(obj, *args, **kwargs)
            finally:
                self.marks.setdefault(after, time.perf_counter())

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)


def _pipeline(args, spares: int = 0) -> Pipeline:
    torch.manual_seed(0)
    stages = [SleepyLinear(32, args.stage_ms / 1e3) for _ in range(args.actors)]
    return Pipeline(stages, schedule="1f1b", num_microbatches=4, loss_fn=torch.nn.functional.mse_loss,
                    optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9), device="cpu",
                    spare_actors=spares)


def _data(steps: int) -> list:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(16, 32, generator=g), torch.randn(16, 32, generator=g)) for _ in range(steps)]


def measure_recovery(args, mode: str, data: list, spares: int = 0) -> tuple[dict, list, dict]:
    """One fit with one kill (``spares`` warm spare actors): the phases' seconds, the losses, the final state."""
    import ray

    clock = _Clock()
    undo = [clock.wrap(FitCheckpoints, "restart", "detected", "loaded"),
            clock.wrap(Fleet, "restart", "teardown", "actors")]
    pipe = _pipeline(args, spares)
    pipe.engine.fleet.spares.wait_started()  # the spares are warm
    victim = pipe.actors[1]
    step_s: list[float] = []

    def kill() -> None:
        clock.marks["kill"] = time.perf_counter()
        ray.kill(victim, no_restart=True)

    def on_step(record: dict) -> None:
        clock.completed.append((time.perf_counter(), record["step"]))
        step_s.append(record["step_time_s"])
        if mode == "mid-step" and record["step"] == args.kill_at - 1 and "kill" not in clock.marks:
            threading.Timer(max(step_s[-5:]) / 2, kill).start()  # the next step is in flight

    def batches():
        for i, batch in enumerate(data):
            if mode == "between" and i == args.kill_at and "kill" not in clock.marks:
                time.sleep(2 * max(step_s[-5:]))  # the step in flight finishes; the actors go idle
                kill()
            yield batch

    try:
        with tempfile.TemporaryDirectory() as tmp:
            losses = pipe.fit(batches(), progress=False, checkpoint_dir=tmp, checkpoint_every=args.every,
                              max_restarts=2, callbacks=[on_step], checkpoint_async=args.asynchronous)
            state = pipe.state_dict()
    finally:
        for u in undo:
            u()
        pipe.shutdown()
    m = clock.marks
    before = max((s for t, s in clock.completed if t < m["kill"]), default=0)
    resumed = next(t for t, s in clock.completed if t > m["loaded"] and s > before)
    phases = {"detection": m["detected"] - m["kill"], "new actors": m["actors"] - m["detected"],
              "checkpoint load": m["loaded"] - m["actors"], "replay": resumed - m["loaded"],
              "total": resumed - m["kill"], "steps replayed": before - (before // args.every) * args.every + 1,
              "step s": sorted(step_s)[len(step_s) // 2]}
    return phases, list(losses), state


def actor_start_seconds(actors: int) -> float:
    """Seconds to place and start ``actors`` bare StageWorker processes (to their first reply):
    the part of "new actors" a warm spare would save."""
    from actors.grid import DeviceGrid

    from mpmd.runtime import cluster

    t0 = time.perf_counter()
    handles, pg = cluster.create_actors(grid=DeviceGrid(dp=1, pp=actors), device="cpu", num_cpus=1.0, num_gpus=0.0,
                                        placement="pack", seed=0, ready_timeout_s=60.0)
    cluster.wait_started(handles)
    seconds = time.perf_counter() - t0
    cluster.teardown(handles, pg, graceful=False)
    return seconds


def run(args) -> int:
    ensure_ray(args.actors)
    data = _data(args.steps)
    with _pipeline(args) as pipe:  # the uninterrupted run: what every restart must equal
        reference = list(pipe.fit(data, progress=False))
        reference_state = pipe.state_dict()
    rows = []
    for mode, spares in [(m, n) for m in MODES for n in ((0, args.actors) if args.spares else (0,))]:
        phases, losses, state = measure_recovery(args, mode, data, spares)
        same = losses == reference and all(torch.equal(state[k], reference_state[k]) for k in reference_state)
        seconds = (f"{phases[k]:.2f}" for k in ("detection", "new actors", "checkpoint load", "replay", "total"))
        rows.append([mode, str(spares), *seconds,
                     f"{phases['steps replayed']} x {phases['step s'] * 1e3:.0f} ms", "yes" if same else "NO"])
    print(f"{args.actors} actors, 1F1B, checkpoint every {args.every} steps "
          f"({'asynchronous' if args.asynchronous else 'blocking'}), rank 1 killed at step {args.kill_at}; "
          f"seconds from ray.kill")
    print_table(["kill", "spares", "detection", "new actors", "checkpoint load", "replay", "total", "replayed",
                 "bit-identical"], rows)
    starts = [actor_start_seconds(args.actors) for _ in range(2)]
    print(f"of 'new actors': starting {args.actors} bare actor processes alone takes "
          f"{', '.join(f'{s:.2f}' for s in starts)} s (placement, process start, imports: what a warm spare saves)")
    return 0 if all(r[-1] == "yes" for r in rows) else 1
