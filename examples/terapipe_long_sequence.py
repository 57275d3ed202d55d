"""TeraPipe on one long sequence: unsliced 1F1B (one microbatch) against token slices,
uniform, DP-planned on compute alone, and ``token_slices="auto"`` (planned with the
per-slice overhead measured on the actors), on 2 and 4 actors.  Prints a table of
measured step times next to what auto's calibrated step model predicts for each.

    python examples/terapipe_long_sequence.py                 # seq_len 512, 2 and 4 actors
    python examples/terapipe_long_sequence.py --seq-len 1024 --steps 20

With batch 1 and one microbatch a plain pipeline runs one stage at a time; token
slices let stage k work on slice i while stage k-1 works on slice i+1.  The slicings
train the same model (tests/mpmd/terapipe/test_terapipe_runtime.py); only the time differs.
The pipelines of one actor count are all up at once and take turns, one step each, so
a load that comes and goes on the machine falls on every row alike.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import statistics
import time

import ray
import torch

import mpmd
from mpmd.models import GPTConfig, gpt_stages, lm_loss
from schedules.slicing import uniform_slices


def take_turns(pipes: list, data: list, steps: int, warmup: int) -> list[list[float]]:
    """Each pipeline's step times: round after round, one step of each pipeline."""
    times: list[list[float]] = [[] for _ in pipes]
    for i in range(warmup + steps):
        x, y = data[i % len(data)]
        for k, pipe in enumerate(pipes):
            t0 = time.perf_counter()
            pipe.step(x, y)
            if i >= warmup:
                times[k].append(time.perf_counter() - t0)
    return times


def rows_for(p: int, cfg: GPTConfig, args, data: list) -> tuple[list, object]:
    stages = gpt_stages(cfg, p)
    with contextlib.ExitStack() as stack:
        def start(**kw):
            return stack.enter_context(mpmd.Pipeline(
                stages, loss_fn=lm_loss, optimizer=lambda q: torch.optim.AdamW(q, lr=1e-4), device="cpu", **kw))

        auto = start(schedule="terapipe", token_slices="auto")  # measures the overhead on its actors, first
        model, g = auto.token_slicing.step_model, auto.token_slicing.granularity
        units = args.seq_len // g
        runs = [("1f1b, unsliced (m=1)", start(schedule="1f1b", num_microbatches=1), (args.seq_len,))]
        for n in sorted({2, p, 2 * p, 4 * p}):
            if n <= units and units % n == 0:
                u = uniform_slices(args.seq_len, n, g)
                runs.append(("terapipe, uniform", start(schedule="terapipe", token_slices=u), u))
        compute_only = start(schedule="terapipe", token_slices="auto", slice_overhead=0.0)
        runs.append(("terapipe, DP compute only", compute_only, compute_only.token_slicing.slices))
        runs.append(("terapipe, auto", auto, auto.token_slicing.slices))
        times = take_turns([pipe for _, pipe, _ in runs], data, args.steps, args.warmup)
    medians = [statistics.median(t) for t in times]
    best_uniform = min(t for (name, _, _), t in zip(runs, medians) if "uniform" in name)
    rows = [(p, name, len(slices), _short(slices), t * 1e3, medians[0] / t, model(slices) * 1e3, best_uniform / t)
            for (name, _, slices), t in zip(runs, medians)]
    return rows, model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--actors", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)

    cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1), generator=g)
        data.append((tokens[:, :-1], tokens[:, 1:]))
    # One Ray for every pipeline, with room for the actors of all rows at once.
    ray.init(num_cpus=max(os.cpu_count() or 1, 8 * max(args.actors)), include_dashboard=False,
             logging_level=logging.WARNING)
    rows, models = [], []
    try:
        for p in args.actors:
            got, model = rows_for(p, cfg, args, data)
            rows += got
            models.append((p, model))
    finally:
        ray.shutdown()
    print(f"\nGPT d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads}, one sequence of {args.seq_len} "
          f"tokens (batch 1), CPU/gloo actors; median of {args.steps} steps after {args.warmup} warm-up, the rows "
          f"taking turns; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for p, model in models:
        probes = ", ".join(f"{len(s)}{'v' if len(set(s)) > 1 else 'u'} {t * 1e3:.0f}" for s, t in model.measured)
        print(f"  {p} actors, auto measured {model}; probes (slices, u: one length, v: varying; ms): {probes}")
    head = ("actors", "schedule", "slices", "slice lengths", "step ms", "speed-up", "predicted", "vs uniform")
    print(f"{head[0]:>6}  {head[1]:<25} {head[2]:>6}  {head[3]:<34} {head[4]:>8} {head[5]:>8} {head[6]:>9} "
          f"{head[7]:>10}")
    for p, name, n, lens, ms, speed, predicted, vs in rows:
        print(f"{p:>6}  {name:<25} {n:>6}  {lens:<34} {ms:>8.1f} {speed:>7.2f}x {predicted:>9.1f} {vs:>9.2f}x")
    print("speed-up: against unsliced 1f1b on the same number of actors; vs uniform: the best uniform slicing's "
          "step time over this row's.\npredicted: ms, auto's calibrated step model, model(slices) + (n + K - 1) o + c "
          "(Note [calibrated slices] in mpmd/terapipe/calibrate.py).\n'DP compute only': token_slices='auto' with "
          "slice_overhead=0, TeraPipe's DP on the in-process compute model alone.")
    return 0


def _short(slices) -> str:
    text = ",".join(map(str, slices))
    return text if len(text) <= 34 else text[:31] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
