"""``python -m mpmd bench dispatch``: what one step costs the controller per actor as the
pipeline deepens, with stages that cost almost nothing so dispatch is all there is.

For p = 2, 4, 8, 16 actors (fractional CPUs, 1F1B, ``fusion="step"`` over the step
channels) it measures the controller's CPU time and wall time to issue a step, two ways
in alternating steps on the same actors: the payload-free actors' calls pickled once and
sent as the same bytes (Note [bare calls] in ``mpmd/runtime/dispatch.py``), and every
call pickled on its own.  Only the first and last actors carry data, so the slope of a
line through the CPU times against the number of payload-free actors is the cost of one
more such actor; the intercept is the data's.  The projection to 1,024 actors is that
line, read at 1,022 payload-free actors.
"""

from __future__ import annotations

import statistics

import torch

from mpmd.pipeline import Pipeline
from .harness import ensure_ray, print_table

__all__ = ["HELP", "add_arguments", "run", "measure_dispatch", "fit_line", "MODES"]

HELP = "controller dispatch per actor and step for p = 2..16 actors"

MODES = {"shared bytes": True, "pickled per actor": False}


def add_arguments(p) -> None:
    p.add_argument("--actors", type=int, nargs="+", default=[2, 4, 8, 16], help="pipeline depths to measure")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=40, help="measured steps per depth and mode (median reported)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--project", type=int, default=1024, help="actor count to project the fitted line to")
    p.set_defaults(run=run)


def measure_dispatch(actors: int, microbatches: int, steps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Per mode: median controller CPU and wall seconds to issue a step on ``actors`` actors."""
    torch.manual_seed(0)
    stages = [torch.nn.Linear(4, 4) for _ in range(actors)]
    x, y = torch.randn(microbatches, 4), torch.randn(microbatches, 4)
    got = {mode: {"cpu": [], "wall": [], "bare": []} for mode in MODES}
    with Pipeline(stages, schedule="1f1b", num_microbatches=microbatches, loss_fn=torch.nn.functional.mse_loss,
                  optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", num_cpus=min(1.0, 2 / actors)) as pipe:
        if not pipe.engine.uses_step_channel:
            raise RuntimeError("the step channels did not open; dispatch over Ray tasks is not what this measures")
        for i in range(warmup + steps):
            for mode, shared in MODES.items():  # alternating: a slow spell falls on both modes
                pipe.engine.set_fusion("step", bare_calls=shared)
                pipe.step(x, y)
                if i >= warmup:
                    last = pipe.engine.last_dispatch
                    got[mode]["cpu"].append(last.cpu_s)
                    got[mode]["wall"].append(last.wall_s)
                    got[mode]["bare"].append(last.bare)
        pipe.engine.set_fusion("step")
    return {mode: {k: statistics.median(v) for k, v in d.items()} for mode, d in got.items()}


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``(intercept, slope)`` of ``ys`` against ``xs``."""
    if len(set(xs)) < 2:
        raise ValueError("fitting a line needs at least two different actor counts; pass --actors 2 8 16")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def run(args) -> int:
    if min(args.actors) < 2:
        raise SystemExit("bench dispatch: every --actors value must be at least 2 (a first and a last stage)")
    ensure_ray(2)  # fractional CPUs: every depth fits on two logical CPUs
    results = {}
    for p in sorted(set(args.actors)):
        print(f"[bench dispatch] {p} actors ...", flush=True)
        results[p] = measure_dispatch(p, args.microbatches, args.steps, args.warmup)
    header = ["actors", "payload-free"] + [f"{m}: {k} µs/step" for m in MODES for k in ("CPU", "wall")]
    rows = [[str(p), str(p - 2)] + [f"{r[m][k] * 1e6:.0f}" for m in MODES for k in ("cpu", "wall")]
            for p, r in results.items()]
    print(f"Controller dispatch per step, 1f1b, {args.microbatches} microbatches, Linear(4, 4) stages, "
          f"fusion='step' over the step channels; median of {args.steps} steps per mode, alternating")
    print_table(header, rows)
    free = [p - 2 for p in results]
    print(f"\nA line through the CPU times against payload-free actors; projected to {args.project} actors:")
    line_header = ["mode", "data (intercept) µs", "µs per payload-free actor", f"ms per step at {args.project}"]
    line_rows = []
    for m in MODES:
        a, b = fit_line(free, [r[m]["cpu"] * 1e6 for r in results.values()])
        line_rows.append([m, f"{a:.0f}", f"{b:.1f}", f"{(a + b * (args.project - 2)) / 1e3:.1f}"])
    print_table(line_header, line_rows)
    return 0
