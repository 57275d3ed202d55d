"""``python -m mpmd bench memory``: what ZeRO-1 (``zero=1``) saves and costs, on the bench GPT
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

import torch

from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss
from mpmd.pipeline import Pipeline
from .harness import PipelineSet, demo_text, ensure_ray, print_table, time_rounds

__all__ = ["HELP", "add_arguments", "run", "CONFIGS"]

HELP = "bytes per parameter per actor and step time, zero=0 against zero=1"

CONFIGS = [(2, 0), (2, 1), (4, 0), (4, 1)]  # (dp, zero)


def add_arguments(p) -> None:
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
    held = {}
    with PipelineSet() as pipes:
        for dp, zero in CONFIGS:
            pipes[dp, zero] = Pipeline(gpt_stages(cfg, args.actors), schedule=args.schedule,
                                       num_microbatches=args.microbatches, loss_fn=lm_loss, device="cpu",
                                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), dp=dp, zero=zero)
        for (dp, zero), pipe in pipes.items():
            pipe.step(*_batch(batches[0], args.batch_size * dp))  # the optimizer state exists after a step
            held[dp, zero] = pipe.engine.client.memory_bytes()
        counts = [sum(p.numel() for s in pipes[CONFIGS[0]].schedule.stages_of(r)
                      for p in pipes[CONFIGS[0]].engine.stages[s].parameters()) for r in range(args.actors)]
        times = time_rounds(pipes, lambda key: [_batch(b, args.batch_size * key[0]) for b in batches[1:]],
                            args.rounds).seconds
    print(f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len}, {args.schedule} on {args.actors} "
          f"ranks, {args.microbatches} microbatches of {args.batch_size // args.microbatches} per replica, AdamW "
          f"fp32 (CPU); median of {args.steps * args.rounds} steps each")
    rows = []
    for dp, zero in CONFIGS:
        per = [(h["params"], h["grads"], h["optimizer"]) for h in held[dp, zero]]
        worst = max(range(len(per)), key=lambda i: per[i][2] / counts[i % args.actors])
        n = counts[worst % args.actors]
        p, g, o = (b / n for b in per[worst])
        base = held[dp, 0][worst]["optimizer"] / n
        t, t0 = statistics.median(times[dp, zero]), statistics.median(times[dp, 0])
        rows.append((str(dp), str(zero), f"{p:.2f}", f"{g:.2f}", f"{o:.2f}", f"{p + g + o:.2f}", f"{o / base:.3f}",
                     f"{1 / dp:.2f}", f"{t * 1e3:.1f}", f"{t / t0:.2f}"))
    print_table(("dp", "zero", "params B/p", "grads B/p", "optim B/p", "total B/p", "optim x zero0", "1/dp", "step ms",
                 "x zero0"), rows)
    print("B/p: bytes per parameter of the actor holding the most optimizer state per parameter; "
          "optim x zero0: its optimizer bytes over zero=0's at the same dp")
    return 0


def _batch(batch, rows: int):
    x, y = batch
    return x[:rows], y[:rows]
