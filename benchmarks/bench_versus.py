"""``python -m mpmd bench versus``: every schedule both runtimes have, against
``torch.distributed.pipelining``, on wide and on tiny stages, in one run.

The model is 8 x ``Linear(width, width)`` on 2 processes (CPU, gloo, one intra-op thread
each), cut as each schedule cuts it (two stages of four layers for gpipe, 1f1b and zb-h1;
four stages of two for interleaved-1f1b and the V schedules), trained with AdamW on
``mse_loss``.  Two shapes:

- ``wide``: width 1024, 8 microbatches of 32 rows: the stages are compute-bound;
- ``tiny``: width 64, 32 microbatches of 4 rows: what each runtime adds per instruction
  and per message is most of the step.

For each shape and schedule, mpmd (steps issued as ``fit`` issues them) and torch's schedule
(free-running, a fresh pair of processes each round) take turns, round after round (Note
[alternating rounds] in harness.py); the table gives each round's throughput ratio and
their median.  For the wide shape it also measures this machine's limit in the same run:
plain gradient accumulation in one 1-thread process, alone and as two at once (so two
processes' throughput over one's), and prints each schedule's throughput over the one
process's as a share of that limit.
"""

from __future__ import annotations

import functools
import statistics
import time

import torch

from .bench import TORCH_SCHEDULES, measure_ahead, measure_torch
from .bench_config import BenchConfig, bench_optimizer, stages_per_rank
from .bench_overhead import LAYERS, tiny_model
from .harness import ensure_ray, print_table, progress, ratios_text

__all__ = ["HELP", "add_arguments", "run", "SHAPES", "measure_alone_and_paired"]

HELP = "every schedule against torch.distributed.pipelining, wide and tiny stages, ratio per round and median"

# name -> (width, microbatches, rows per step)
SHAPES = {"wide": (1024, 8, 256), "tiny": (64, 32, 128)}


def add_arguments(p) -> None:
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--schedules", nargs="+", default=list(TORCH_SCHEDULES), choices=list(TORCH_SCHEDULES))
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of mpmd and torch (default: 3)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per round and runtime (median of each)")
    p.add_argument("--warmup", type=int, default=2)
    p.set_defaults(run=run)


def run(args) -> int:
    ensure_ray(2)
    rows, limits = [], {}
    for shape in args.shapes:
        width, m, rows_per_step = SHAPES[shape]
        cfg = BenchConfig(schedules=tuple(args.schedules), actors=2, microbatches=m, batch_size=rows_per_step,
                          steps=args.steps, warmup=args.warmup, n_layers=LAYERS, rounds=args.rounds)
        model = functools.partial(tiny_model, batch_size=rows_per_step, steps=args.warmup + args.steps + 1,
                                  width=width)
        single = None
        if shape == "wide":
            progress(f"bench versus: {shape}: one process alone and two at once")
            single, limits[shape] = measure_alone_and_paired(model, m, args.warmup, args.steps, args.rounds)
        for name in args.schedules:
            progress(f"bench versus: {shape} {name}")
            ours, theirs = _alternate(cfg, name, model)
            ratios = [statistics.median(t) / statistics.median(o) for o, t in zip(ours, theirs)]
            step = statistics.median(s for o in ours for s in o)
            rows.append([shape, name, f"{step * 1e3:.1f}",
                         f"{statistics.median(s for t in theirs for s in t) * 1e3:.1f}",
                         ratios_text(ratios), f"{statistics.median(ratios):.2f}x",
                         f"{single / step:.2f}x ({single / step / limits[shape]:.0%})" if single else "-"])
    print(f"\n8 x Linear(width), 2 processes (CPU, gloo, 1 thread each), AdamW; {args.steps} timed steps per "
          f"round, {args.rounds} alternating rounds")
    for shape, limit in limits.items():
        print(f"{shape}: this machine's limit (two 1-thread processes' throughput over one's): {limit:.2f}x")
    print_table(["shape", "schedule", "mpmd step ms", "torch step ms", "mpmd / torch per round", "median",
                 "mpmd / one process (of limit)"], rows)
    return 0


def _alternate(cfg: BenchConfig, name: str, model) -> tuple[list, list]:
    """Per round, mpmd's step times then torch's, for one schedule."""
    import mpmd

    stages, batches = model(cfg.actors * stages_per_rank(name))
    ours, theirs = [], []
    with mpmd.Pipeline(stages, schedule=name, num_microbatches=cfg.microbatches, num_actors=cfg.actors,
                       loss_fn=torch.nn.functional.mse_loss, optimizer=bench_optimizer, device="cpu") as pipe:
        for _ in range(cfg.rounds):
            ours.append(measure_ahead(pipe, batches, cfg.warmup, cfg.steps))
            theirs.append(measure_torch(cfg, name, model=model, loss=torch.nn.functional.mse_loss))
    return ours, theirs


def measure_alone_and_paired(model, microbatches: int, warmup: int, steps: int, rounds: int) -> tuple[float, float]:
    """One 1-thread process's median step time doing plain gradient accumulation, and the
    machine's limit: two such processes at once over one alone, in throughput (alternating
    rounds of one, then two)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    alone, paired = [], []
    for _ in range(rounds):
        for n, out in ((1, alone), (2, paired)):
            queue, barrier = ctx.SimpleQueue(), ctx.Barrier(n)
            mp.start_processes(_accumulate, args=(model, microbatches, warmup, steps, barrier, queue), nprocs=n,
                               join=True, start_method="spawn")
            out += [statistics.median(queue.get()) for _ in range(n)]
    one, two = statistics.median(alone), statistics.median(paired)
    return one, 2 * one / two


def _accumulate(rank: int, model, microbatches: int, warmup: int, steps: int, barrier, queue) -> None:
    torch.set_num_threads(1)
    stages, batches = model(1)
    net = stages[0]
    opt = bench_optimizer(net.parameters())
    times = []
    barrier.wait()
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        for xm, ym in zip(x.chunk(microbatches), y.chunk(microbatches)):
            (torch.nn.functional.mse_loss(net(xm), ym) / microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    queue.put(times[warmup:])
