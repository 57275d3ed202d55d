"""TeraPipe on one long sequence: unsliced 1F1B (one microbatch) against token slices,
uniform, DP-planned on compute alone, and ``token_slices="auto"`` (planned with the
per-slice overhead measured on the actors), on 2 and 4 actors.  Prints a table of
measured step times next to what auto's calibrated step model predicts for each.

    python examples/terapipe_long_sequence.py                 # seq_len 512, 2 and 4 actors
    python examples/terapipe_long_sequence.py --seq-len 1024 --steps 8

With batch 1 and one microbatch a plain pipeline runs one stage at a time; token
slices let stage k work on slice i while stage k-1 works on slice i+1.  The slicings
train the same model (tests/runtime/test_terapipe_runtime.py); only the time differs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpmd
from mpmd.models import GPTConfig, gpt_stages, lm_loss
from schedules.slicing import uniform_slices


def step_times(stages, steps: int, warmup: int, data, **kwargs) -> tuple[list[float], object]:
    with mpmd.Pipeline(stages, loss_fn=lm_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                       device="cpu", **kwargs) as pipe:
        times = []
        for i in range(warmup + steps):
            x, y = data[i % len(data)]
            t0 = time.perf_counter()
            pipe.step(x, y)
            times.append(time.perf_counter() - t0)
        return times[warmup:], pipe


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--actors", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args(argv)

    cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    data = []
    for _ in range(4):
        tokens = torch.randint(0, cfg.vocab_size, (1, args.seq_len + 1), generator=g)
        data.append((tokens[:, :-1], tokens[:, 1:]))
    rows, models = [], []
    for p in args.actors:
        stages = gpt_stages(cfg, p)

        def run(**kw):
            return step_times(stages, args.steps, args.warmup, data, **kw)

        auto, pipe = run(schedule="terapipe", token_slices="auto")  # measures the overhead on its actors
        model = pipe.token_slicing.step_model  # predicts a step of any slicing on these actors
        models.append((p, model))
        compute_only, pipe_c = run(schedule="terapipe", token_slices="auto", slice_overhead=0.0)
        runs = [("1f1b, unsliced (m=1)", run(schedule="1f1b", num_microbatches=1)[0], (args.seq_len,))]
        units = args.seq_len // pipe.token_slicing.granularity
        for n in (p, 2 * p, 4 * p, 8 * p):
            if n <= units and units % n == 0:
                u = uniform_slices(args.seq_len, n, pipe.token_slicing.granularity)
                runs.append(("terapipe, uniform", run(schedule="terapipe", token_slices=u)[0], u))
        runs.append(("terapipe, DP compute only", compute_only, pipe_c.token_slicing.slices))
        runs.append(("terapipe, auto", auto, pipe.token_slicing.slices))
        b = statistics.median(runs[0][1])
        best_uniform = min(statistics.median(t) for name, t, _ in runs if "uniform" in name)
        for name, times, slices in runs:
            t = statistics.median(times)
            rows.append((p, name, len(slices), _short(slices), t * 1e3, b / t, model(slices) * 1e3,
                         best_uniform / t))
    print(f"\nGPT d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads}, one sequence of "
          f"{args.seq_len} tokens (batch 1), CPU/gloo actors; median of {args.steps} steps after {args.warmup} warm-up")
    for p, model in models:
        print(f"  {p} actors, auto measured: {model}")
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
