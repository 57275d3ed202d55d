"""``python -m mpmd bench-memory``: what ZeRO-1 (``zero=1``) saves and costs, on the bench GPT
with AdamW: per actor, bytes per parameter of parameters, gradients and optimizer state, and
the step time, for ``zero=0`` and ``zero=1`` at dp=2 and dp=4, every pipeline alive at once
in one run, with ratios against ``zero=0`` at the same dp.

The bytes are what each actor holds (``memory_bytes`` on the actors: its stages' parameters,
the gradients it keeps past the data-parallel reduction, every tensor of its optimizers'
state), counted after a step, divided by its stages' parameter count; the table shows the
actor holding the most optimizer state.  Step times are medians over alternating rounds, so
a slow spell on a shared machine falls on every configuration.
"""

from __future__ import annotations

import statistics
import time

import torch

from ..models import GPTConfig, char_dataset, gpt_stages, lm_loss
from ..pipeline import Pipeline
from .bench import ensure_ray
from .demo import demo_text

__all__ = ["add_parser", "run", "CONFIGS"]

CONFIGS = [(2, 0), (2, 1), (4, 0), (4, 1)]  # (dp, zero)


def add_parser(sub) -> None:
    p = sub.add_parser("bench-memory", help="bytes per parameter per actor and step time, zero=0 against zero=1")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--actors", type=int, default=2, help="pipeline ranks (each configuration: ranks x dp actors)")
    p.add_argument("--microbatches", type=int, default=2, help="per replica")
    p.add_argument("--batch-size", type=int, default=4, help="per replica")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=3, help="measured steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2)
    p.set_defaults(run=run)


def run(args) -> int:
    ensure_ray(sum(args.actors * dp for dp, _ in CONFIGS))  # every configuration's actors at once
    cfg = GPTConfig(vocab_size=64, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    _, batches = char_dataset(demo_text(), seq_len=args.seq_len, batch_size=args.batch_size * 4, steps=args.steps + 1)
    pipes, held, times = {}, {}, {c: [] for c in CONFIGS}
    try:
        for dp, zero in CONFIGS:
            pipes[dp, zero] = Pipeline(gpt_stages(cfg, args.actors), schedule=args.schedule,
                                       num_microbatches=args.microbatches, loss_fn=lm_loss, device="cpu",
                                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), dp=dp, zero=zero)
        for (dp, zero), pipe in pipes.items():
            pipe.step(*_batch(batches[0], args.batch_size * dp))  # the optimizer state exists after a step
            held[dp, zero] = pipe.engine.call_actors("memory_bytes", what="memory_bytes")
        counts = [sum(p.numel() for s in pipes[CONFIGS[0]].schedule.stages_of(r)
                      for p in pipes[CONFIGS[0]].engine.stages[s].parameters()) for r in range(args.actors)]
        for _ in range(args.rounds):
            for (dp, zero), pipe in pipes.items():
                for x, y in batches[1:]:
                    x, y = _batch((x, y), args.batch_size * dp)
                    t0 = time.perf_counter()
                    pipe.step(x, y)
                    times[dp, zero].append(time.perf_counter() - t0)
    finally:
        for pipe in pipes.values():
            pipe.shutdown()
    print(f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len}, {args.schedule} on {args.actors} "
          f"ranks, {args.microbatches} microbatches of {args.batch_size // args.microbatches} per replica, AdamW "
          f"fp32 (CPU); median of {args.steps * args.rounds} steps each")
    print(f"{'dp':>3}{'zero':>5}{'params B/p':>11}{'grads B/p':>10}{'optim B/p':>10}{'total B/p':>10}"
          f"{'optim x zero0':>14}{'1/dp':>6}{'step ms':>9}{'x zero0':>8}")
    for dp, zero in CONFIGS:
        per = [(h["params"], h["grads"], h["optimizer"]) for h in held[dp, zero]]
        worst = max(range(len(per)), key=lambda i: per[i][2] / counts[i % args.actors])
        n = counts[worst % args.actors]
        p, g, o = (b / n for b in per[worst])
        base = held[dp, 0][worst]["optimizer"] / n
        t, t0 = statistics.median(times[dp, zero]), statistics.median(times[dp, 0])
        print(f"{dp:>3}{zero:>5}{p:>11.2f}{g:>10.2f}{o:>10.2f}{p + g + o:>10.2f}{o / base:>14.3f}{1 / dp:>6.2f}"
              f"{t * 1e3:>9.1f}{t / t0:>8.2f}")
    print("B/p: bytes per parameter of the actor holding the most optimizer state per parameter; "
          "optim x zero0: its optimizer bytes over zero=0's at the same dp")
    return 0


def _batch(batch, rows: int):
    x, y = batch
    return x[:rows], y[:rows]
