"""``python -m mpmd bench overhead``: where each actor's step goes on stages that cost almost
nothing, so that what the runtime adds per instruction is most of the step.

The model is 8 x ``Linear(64, 64)`` (m = 32 microbatches of 4 rows by default), on 2 actors
(CPU, gloo, one thread each), under 1f1b (two stages of four layers) and interleaved-1f1b
(four stages of two).  Per schedule it prints the profiler's split of each actor's step
window (Note [where a step goes] in mpmd/profiler/split.py: compute, waiting on a peer,
communication work, data, optimizer, the actor's own overhead) with the own time per
instruction kind and per instruction, next to the step time of mpmd (``fusion="step"``,
steps issued as ``fit`` issues them) and of ``torch.distributed.pipelining`` (free-running)
on the same model, split, schedule and processes, in alternating rounds (Note [alternating
rounds] in harness.py).  ``--width 1024 -m 8 --batch-size 256`` gives ``bench versus``'s
wide shape instead.
"""

from __future__ import annotations

import functools
import statistics

import torch

from mpmd.profiler import profile_pipeline
from .bench import TORCH_SCHEDULES, measure_ahead, measure_torch
from .bench_config import BenchConfig, stages_per_rank
from .harness import ensure_ray, print_table, ratios_text

__all__ = ["HELP", "add_arguments", "run", "tiny_model", "WIDTH", "LAYERS"]

HELP = ("where each actor's step goes (compute, wait, comm, own overhead per instruction) on tiny stages "
        "(--width for wider ones)")

WIDTH, LAYERS = 64, 8


def add_arguments(p) -> None:
    p.add_argument("--schedule", default="1f1b,interleaved-1f1b", help="comma-separated schedules")
    p.add_argument("--microbatches", "-m", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=128, help="rows per step (default: 128, 4 per microbatch)")
    p.add_argument("--width", type=int, default=WIDTH,
                   help=f"features per layer (default: {WIDTH}; bench versus's wide shape: 1024, -m 8, --batch-size 256)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round and runtime (median reported)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profiled", type=int, default=5, help="profiled steps for the split (default: 5)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds of mpmd and torch (default: 2)")
    p.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    p.set_defaults(run=run)


def tiny_model(num_stages: int, batch_size: int, steps: int, width: int = WIDTH):
    """``LAYERS`` x ``Linear(width, width)`` cut into ``num_stages`` equal stages, and ``steps``
    batches of ``batch_size`` rows (deterministic)."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(width, width) for _ in range(LAYERS)]
    per = LAYERS // num_stages
    stages = [torch.nn.Sequential(*layers[i * per:(i + 1) * per]) for i in range(num_stages)]
    batches = [(torch.randn(batch_size, width), torch.randn(batch_size, width)) for _ in range(steps)]
    return stages, batches


def run(args) -> int:
    import mpmd

    names = tuple(s.strip() for s in args.schedule.split(",") if s.strip())
    cfg = BenchConfig(schedules=names, actors=2, microbatches=args.microbatches, batch_size=args.batch_size,
                      steps=args.steps, warmup=args.warmup, n_layers=LAYERS, rounds=args.rounds)
    ensure_ray(cfg.actors)
    loss = torch.nn.functional.mse_loss
    summary = []
    for name in names:
        n = cfg.actors * stages_per_rank(name)
        if LAYERS % n:
            raise SystemExit(f"bench overhead: {name} on 2 actors needs {n} stages, which do not divide "
                             f"{LAYERS} layers")
        model = functools.partial(tiny_model, batch_size=cfg.batch_size, steps=cfg.warmup + cfg.steps + 1,
                                  width=args.width)
        stages, batches = model(n)
        ours, theirs, ratios = [], [], []
        with mpmd.Pipeline(stages, schedule=name, num_microbatches=cfg.microbatches, num_actors=cfg.actors,
                           loss_fn=loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), device="cpu") as pipe:
            print(f"[bench overhead] {name}: profiling", flush=True)
            report = profile_pipeline(pipe.engine, *batches[0], steps=args.profiled, warmup=cfg.warmup)
            for r in range(cfg.rounds):
                print(f"[bench overhead] {name}: round {r + 1} of {cfg.rounds}", flush=True)
                mine = measure_ahead(pipe, batches, cfg.warmup, cfg.steps)
                ours += mine
                if not args.no_torch and name in TORCH_SCHEDULES:
                    t = measure_torch(cfg, name, model=model, loss=loss)
                    theirs += t
                    ratios.append(statistics.median(t) / statistics.median(mine))
        print(f"\n{name}: {LAYERS} x Linear({args.width}), {cfg.microbatches} microbatches of "
              f"{cfg.batch_size // cfg.microbatches} rows, 2 actors (CPU, gloo, 1 thread each)")
        for line in report.split_lines():
            print(line)
        summary.append((name, f"{report.own_per_instruction_seconds * 1e6:.1f}",
                        f"{report.own_cpu_per_instruction_seconds * 1e6:.1f}",
                        f"{statistics.median(ours) * 1e3:.2f}",
                        f"{statistics.median(theirs) * 1e3:.2f}" if theirs else "n/a",
                        f"{statistics.median(ratios):.2f}x ({ratios_text(ratios)})" if ratios else "-"))
    print(f"\nSummary: own us per instruction (profiled steps) and step time (ms, median of {cfg.steps} steps x "
          f"{cfg.rounds} alternating rounds)")
    print_table(("schedule", "own us/instr", "own CPU us/instr", "mpmd step ms", "torch.pipelining step ms",
                 "mpmd / torch throughput (per round)"), summary)
    return 0
