"""``python -m mpmd bench first``: the first pipeline after Ray starts against the next ones
(Note [first pipeline] in ``mpmd/runtime/cluster.py``).

Each round is a fresh Python process (the effect lives in a process's first minutes):
mpmd starts Ray, then 1F1B pipelines of tiny stages are built in turn (2, 2, 4, 2 actors
by default) and each runs ``--steps`` steps.  Warm-up: none beyond what a user gets, the
pipeline's construction (``Pipeline(...)`` returns with the actors up, modules and
programs shipped); the first step of every pipeline is left out of the figures (each
pipeline's actors learn shapes on it, the first as much as the others).  Reported per
pipeline: mean and median step time, the largest step, the controller's dispatch per
step, and the controller's full (generation 2) garbage collections during the steps.
Rounds: ``settled`` (as shipped: a full collection before the first step) and
``unsettled`` (that collection skipped: the runtime before issue 34).  The ratio is the
first pipeline's mean step time over the second's.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time

from .harness import print_table, ratios_text

__all__ = ["HELP", "add_arguments", "run", "measure_round", "round_command"]

HELP = "the first pipeline after ray.init against the next ones (fresh processes)"


def add_arguments(p) -> None:
    p.add_argument("--actors", type=int, nargs="+", default=[2, 2, 4, 2], help="pipelines built in turn")
    p.add_argument("--steps", type=int, default=40, help="steps per pipeline (the first is left out)")
    p.add_argument("--rounds", type=int, default=2, help="fresh processes per variant, alternating")
    p.add_argument("--round", choices=["settled", "unsettled"], help=argparse.SUPPRESS)  # one child process
    p.set_defaults(run=run)


def measure_round(actors: list[int], steps: int, settle: bool) -> list[dict]:
    """In this (fresh) process: the pipelines in turn; per pipeline its step figures."""
    import torch

    from mpmd import Pipeline
    from mpmd.runtime import cluster

    if not settle:
        cluster.settle_heap = lambda: None  # the runtime before Note [first pipeline]
    pauses: list[float] = []
    began: dict = {}

    def watch(phase: str, info: dict) -> None:
        if info["generation"] == 2:
            if phase == "start":
                began["t"] = time.perf_counter()
            elif "t" in began:
                pauses.append(time.perf_counter() - began.pop("t"))

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    rows = []
    for p in actors:
        torch.manual_seed(0)
        with Pipeline([torch.nn.Linear(16, 16) for _ in range(p)], schedule="1f1b", num_microbatches=4,
                      loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                      device="cpu", num_cpus=min(1.0, 2 / p)) as pipe:
            times, dispatch = [], []
            gc.callbacks.append(watch)
            pauses.clear()
            for i in range(steps):
                t0 = time.perf_counter()
                pipe.step(x, y)
                if i:
                    times.append(time.perf_counter() - t0)
                    dispatch.append(pipe.engine.last_dispatch.wall_s)
            gc.callbacks.remove(watch)
        rows.append({"actors": p, "mean": statistics.fmean(times), "median": statistics.median(times),
                     "max": max(times), "dispatch": statistics.fmean(dispatch), "gc2": list(pauses)})
    return rows


def round_command(args, variant: str) -> list[str]:
    """The fresh process that runs one round of ``variant`` (``settled`` or ``unsettled``)."""
    return [sys.executable, "-m", "mpmd", "bench", "first", "--round", variant, "--steps", str(args.steps),
            "--actors", *map(str, args.actors)]


def run(args) -> int:
    if args.round:  # a child process: one round, as JSON
        print("ROUND " + json.dumps(measure_round(args.actors, args.steps, args.round == "settled")), flush=True)
        return 0
    results: dict[str, list] = {"unsettled": [], "settled": []}
    for _ in range(args.rounds):
        for variant in results:  # alternating: a slow spell on the machine falls on both
            out = subprocess.run(round_command(args, variant), capture_output=True, text=True,
                                 env=os.environ.copy(), check=True).stdout
            results[variant].append(json.loads(out.split("ROUND ", 1)[1].splitlines()[0]))
    print(f"1F1B pipelines of {args.actors} actors built in turn in a fresh process after mpmd starts Ray; "
          f"{args.steps - 1} steps each after its first; no warm-up but construction; {args.rounds} rounds")
    header = ["variant", "round", "pipeline", "actors", "mean ms", "median ms", "max ms", "dispatch ms", "gen-2 GC ms"]
    rows = []
    for variant, rounds in results.items():
        for r, pipes in enumerate(rounds):
            for k, row in enumerate(pipes):
                rows.append([variant, str(r), str(k), str(row["actors"]), f"{row['mean'] * 1e3:.2f}",
                             f"{row['median'] * 1e3:.2f}", f"{row['max'] * 1e3:.1f}", f"{row['dispatch'] * 1e3:.2f}",
                             ", ".join(f"{g * 1e3:.0f}" for g in row["gc2"]) or "-"])
    print_table(header, rows)
    for variant, rounds in results.items():
        ratios = [pipes[0]["mean"] / pipes[1]["mean"] for pipes in rounds]
        medians = [pipes[0]["median"] / pipes[1]["median"] for pipes in rounds]
        pauses = [len(pipes[0]["gc2"]) for pipes in rounds], [sum(len(p["gc2"]) for p in pipes[1:]) for pipes in rounds]
        print(f"{variant:>10}: first / second pipeline, mean step {ratios_text(ratios)} "
              f"(median of rounds {statistics.median(ratios):.2f}x); median step "
              f"{ratios_text(medians)}; gen-2 pauses in the first pipeline's steps "
              f"{sum(pauses[0])}, in the others' {sum(pauses[1])}")
    print("The step times of one pipeline swing up to 2x on a machine shared with other work; the gen-2 pauses "
          "are what the first pipeline had that the others did not.")
    return 0
