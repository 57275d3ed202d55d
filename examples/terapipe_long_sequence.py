"""TeraPipe on one long sequence: unsliced 1F1B (one microbatch) against token slices,
uniform and DP-planned, on 2 and 4 actors.  Prints a table of measured step times.

    python examples/terapipe_long_sequence.py                 # seq_len 512, 2 and 4 actors
    python examples/terapipe_long_sequence.py --seq-len 1024 --steps 8

With batch 1 and one microbatch a plain pipeline runs one stage at a time; token
slices let stage k work on slice i while stage k-1 works on slice i+1.  The slicings
train the same model (tests/test_terapipe_runtime.py); only the time differs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import mpmd
from mpmd.models import GPTConfig, gpt_stages, lm_loss
from schedules.slicing import slicing_time, uniform_slices


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
    rows = []
    for p in args.actors:
        stages = gpt_stages(cfg, p)

        def run(**kw):
            return step_times(stages, args.steps, args.warmup, data, **kw)

        base, _ = run(schedule="1f1b", num_microbatches=1)
        dp, pipe = run(schedule="terapipe", token_slices="auto")
        cost = pipe.token_slicing.cost  # compute only: what token_slices="auto" measured, fitted and planned with
        runs = [("1f1b, unsliced (m=1)", base, (args.seq_len,))]
        for n in sorted({2 * p, len(pipe.token_slicing.slices)}):
            u = uniform_slices(args.seq_len, n)
            runs.append(("terapipe, uniform", run(schedule="terapipe", token_slices=u)[0], u))
        runs.append(("terapipe, DP (auto)", dp, pipe.token_slicing.slices))
        # Per-slice runtime overhead o from the runs so far: step = model + (n + K - 1) * o.
        hops = [len(sl) + p - 1 for _, _, sl in runs]
        gaps = [statistics.median(t) - slicing_time(sl, p, cost) for _, t, sl in runs]
        overhead = max(0.0, sum(h * g for h, g in zip(hops, gaps)) / sum(h * h for h in hops))
        dp_o, pipe_o = run(schedule="terapipe", token_slices=cost, slice_overhead=overhead)
        runs.append((f"terapipe, DP +{overhead * 1e3:.0f}ms/sl", dp_o, pipe_o.token_slicing.slices))
        b = statistics.median(base)
        for name, times, slices in runs:
            t = statistics.median(times)
            model = slicing_time(slices, p, cost)
            rows.append((p, name, len(slices), _short(slices), t * 1e3, b / t, model * 1e3))
    print(f"\nGPT d_model={cfg.d_model} layers={cfg.n_layers} heads={cfg.n_heads}, one sequence of "
          f"{args.seq_len} tokens (batch 1), CPU/gloo actors; median of {args.steps} steps after {args.warmup} warm-up")
    head = ("actors", "schedule", "slices", "slice lengths", "step ms", "speed-up", "model ms")
    print(f"{head[0]:>6}  {head[1]:<22} {head[2]:>6}  {head[3]:<34} {head[4]:>8} {head[5]:>8} {head[6]:>9}")
    for p, name, n, lens, ms, speed, model in rows:
        print(f"{p:>6}  {name:<22} {n:>6}  {lens:<34} {ms:>8.1f} {speed:>7.2f}x {model:>9.1f}")
    print("speed-up: against unsliced 1f1b on the same number of actors.  model ms: the compute-only slice-cost "
          "model token_slices='auto' fitted, sum(t_i) + (K-1) max(t_i).\n'DP +o ms/sl': planned with that model "
          "plus a per-slice overhead o fitted to the measured steps above it (step = model + (n + K - 1) o).")
    return 0


def _short(slices) -> str:
    text = ",".join(map(str, slices))
    return text if len(text) <= 34 else text[:31] + "..."


if __name__ == "__main__":
    raise SystemExit(main())
