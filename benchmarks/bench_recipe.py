"""``python -m mpmd bench recipe``: what activation recompute and bf16 cost and save, on the
bench GPT in one run: step time and each actor's memory growth over its set-up, against
plain fp32, as ratios.

Each configuration runs on fresh actors (a process's peak resident memory cannot be
reset); the step times come from alternating rounds over the configurations, so a slow
spell on a shared machine falls on all of them.  On CPU the memory is the growth of the
actor's peak resident set over its size after set-up (activations, gradients, optimizer
state); on CUDA it is the peak allocated device memory.
"""

from __future__ import annotations

import statistics

import torch

from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss
from mpmd.pipeline import Pipeline
from .harness import PipelineSet, demo_text, ensure_ray, print_table, time_rounds

__all__ = ["HELP", "add_arguments", "run", "CONFIGS"]

HELP = "step time and memory of recompute and bf16 against fp32"

CONFIGS = {"fp32": {}, "recompute": {"recompute": True}, "bf16": {"precision": "bf16"},
           "bf16 + recompute": {"precision": "bf16", "recompute": True}}


def add_arguments(p) -> None:
    p.add_argument("--schedule", default="gpipe", help="gpipe holds every microbatch's activations (default)")
    p.add_argument("--actors", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=4, help="measured steps per configuration and round")
    p.add_argument("--rounds", type=int, default=2)
    p.set_defaults(run=run)


def run(args) -> int:
    ensure_ray(args.actors * len(CONFIGS))  # every configuration's actors at once (1 logical CPU each)
    vocab, batches = char_dataset(demo_text(), seq_len=args.seq_len, batch_size=args.batch_size,
                                  steps=args.steps + 1)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=args.seq_len, d_model=args.d_model, n_heads=4,
                    n_layers=args.layers)
    memory = {}
    with PipelineSet() as pipes:
        for name, options in CONFIGS.items():
            pipe = Pipeline(gpt_stages(cfg, args.actors), schedule=args.schedule, num_microbatches=args.microbatches,
                            loss_fn=lm_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), device="cpu",
                            **options)
            pipes[name] = pipe
            start = pipe.engine.client.rss_bytes(what="memory after set-up")
            pipe.step(*batches[0])  # warm-up; the peak includes every step's activations
            stats = pipe.engine.client.memory_stats(what="peak memory")
            memory[name] = max((s["device_peak_bytes"] or s["peak_rss_bytes"] - r) for s, r in zip(stats, start))
        times = time_rounds(pipes, batches[1:], args.rounds).seconds
    base_t, base_m = statistics.median(times["fp32"]), memory["fp32"]
    print(f"GPT d_model={args.d_model} layers={args.layers} seq={args.seq_len}, batch {args.batch_size} = "
          f"{args.microbatches} microbatches, {args.schedule} on {args.actors} actors (CPU); median of "
          f"{args.steps * args.rounds} steps each")
    rows = []
    for name in CONFIGS:
        t, m = statistics.median(times[name]), memory[name]
        rows.append((name, f"{t * 1e3:.1f}", f"{t / base_t:.2f}", f"{m / 2**20:.1f}", f"{m / base_m:.2f}"))
    print_table(("config", "step ms", "x fp32", "memory MiB", "x fp32"), rows)
    print("memory: the busiest actor's peak growth over its size after set-up (CPU: resident set; CUDA: allocated)")
    return 0
