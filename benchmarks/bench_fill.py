"""``python -m mpmd bench fill``: PipeFill on the demo GPT — main-job slowdown and the
share of bubble time turned into fill work, measured in one run per pipeline depth."""

from __future__ import annotations

import statistics
import time

import torch

from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss
from mpmd.pipefill import FillJob, find_bubbles
from mpmd.pipeline import Pipeline
from .harness import demo_text, median_ratio, print_table, timed

__all__ = ["HELP", "add_arguments", "run"]

HELP = "PipeFill: main-job slowdown and bubble time converted to fill work"


def add_arguments(p) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--pairs", type=int, default=40, help="pairs of one plain step and one step with fill work")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--margin", type=float, default=0.2, help="add_fill_job's safety margin")
    p.add_argument("--idle", action="store_true", help="a fill job that sleeps (no CPU) instead of computing")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the actors share this machine's GPU(s) (fractional num_gpus)")
    p.set_defaults(run=lambda a: run(a.ranks, a.pairs, a.microbatches, a.margin, a.idle, a.device))


def _fill_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _infer(batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _FILL(batch)


_FILL = _fill_model()


def _plain_step(pipe: Pipeline, x, y) -> float:
    """A training step with the fill jobs held back (the same program, its FILL slots empty)."""
    return timed(pipe.engine.train_step, x, y)


def run(ranks: list[int], pairs: int, microbatches: int, margin: float = 0.2, idle: bool = False,
        device: str = "cpu") -> int:
    """Per depth: the bubbles of a few profiled plain steps, then ``pairs`` pairs of one
    plain step and one step with the fill job, alternating (the machine is shared and
    noisy: a pair sees the same conditions, so the slowdown is the median of the pairs'
    ratios).  ``idle``: the fill job sleeps instead of computing (its time, no CPU):
    what the schedule costs, apart from sharing the machine's cores."""
    vocab, batches = char_dataset(demo_text(), seq_len=32, batch_size=16, steps=2 * pairs + 24)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    rows = []
    for p in ranks:
        stages = gpt_stages(cfg, num_stages=p)
        gpus = {"num_gpus": 1.0 / p} if device == "cuda" else {}
        with Pipeline(stages, schedule="1f1b", num_microbatches=microbatches, loss_fn=lm_loss, device=device, **gpus,
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)) as pipe:
            rest = iter(batches)
            for _ in range(3):  # warm-up
                _plain_step(pipe, *next(rest))
            timelines = [pipe.engine.train_step(*next(rest), profile=True).timelines for _ in range(5)]
            # Bubble time: waits of at least 0.5 ms, mean over the profiled steps.
            bubble_s = sum(b.seconds for b in find_bubbles(pipe.engine.program("train"), timelines, [0] * p, 0.0005,
                                                           statistic=statistics.fmean))
            job = FillJob(fn=_sleep if idle else _infer, data=[torch.randn(64) for _ in range(400_000)],
                          name="mlp-infer")
            pipe.add_fill_job(job, min_bubble_s=0.0005, margin=margin)
            fills = pipe.fill_manager
            for _ in range(12):  # places the fill slots, measures the bubbles, probes the job's cost
                pipe.step(*next(rest))
            base, fill, fill_s, samples = [], [], 0.0, 0
            for _ in range(pairs):
                base.append(_plain_step(pipe, *next(rest)))
                s0, n0 = fills.fill_seconds, fills.filled_samples
                fill.append(timed(pipe.step, *next(rest)))
                fill_s += fills.fill_seconds - s0
                samples += fills.filled_samples - n0
            slowdown = median_ratio(fill, base) - 1
            rows.append((p, statistics.median(base), statistics.median(fill), slowdown, bubble_s,
                         fill_s / pairs, samples / pairs))
    print_table(("ranks", "step s", "with fill", "slowdown", "bubble s/step", "fill s/step", "converted",
                 "samples/step"),
                [(str(p), f"{base:.4f}", f"{fill:.4f}", f"{slow:+.1%}", f"{bub:.4f}", f"{fs:.4f}",
                  f"{fs / bub if bub else 0:.1%}", f"{n:.0f}") for p, base, fill, slow, bub, fs, n in rows])
    return 0


def _sleep(batch: torch.Tensor) -> torch.Tensor:
    time.sleep(batch.shape[0] * 1e-6)
    return batch[:, :1]
