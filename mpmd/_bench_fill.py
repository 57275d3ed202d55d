"""``python -m mpmd bench-fill``: PipeFill on the demo GPT — main-job slowdown and the
share of bubble time turned into fill work, measured in one run per pipeline depth."""

from __future__ import annotations

import statistics
import time

import torch

from .models import GPTConfig, char_dataset, gpt_stages, lm_loss
from .pipefill import FillJob, find_bubbles
from .pipeline import Pipeline


def add_parser(sub) -> None:
    p = sub.add_parser("bench-fill", help="PipeFill: main-job slowdown and bubble time converted to fill work")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 3, 4])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.set_defaults(run=lambda a: run(a.ranks, a.steps, a.microbatches))


def _fill_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _infer(batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _FILL(batch)


_FILL = _fill_model()


def _median_step(pipe: Pipeline, batches, steps: int) -> float:
    times = []
    for x, y in batches[:steps]:
        t0 = time.perf_counter()
        pipe.step(x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(ranks: list[int], steps: int, microbatches: int) -> int:
    from ._demo import demo_text

    vocab, batches = char_dataset(demo_text(), seq_len=32, batch_size=16, steps=4 * steps + 8)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    rows = []
    for p in ranks:
        stages = gpt_stages(cfg, num_stages=p)
        with Pipeline(stages, schedule="1f1b", num_microbatches=microbatches, loss_fn=lm_loss, device="cpu",
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)) as pipe:
            _median_step(pipe, batches[:3], 3)  # warm-up
            base = _median_step(pipe, batches[3:], steps)
            raw = pipe._run("train", *batches[3 + steps], profile=True)["raw"]
            pipe._step_count += 1
            bubbles = find_bubbles(pipe._programs["train"], [[r["timeline"] for r in raw]], [0] * p, 0.0005)
            bubble_s = sum(b.seconds for b in bubbles)
            job = pipe.add_fill_job(FillJob(fn=_infer, data=[torch.randn(64) for _ in range(200_000)],
                                            name="mlp-infer"), min_bubble_s=0.0005)
            pipe.step(*batches[4 + steps])  # the measuring step places the fill slots
            pipe.step(*batches[5 + steps])  # the probe step measures the job's cost
            fill_s0, n0 = pipe._fill.fill_seconds, pipe._fill.filled_samples
            with_fill = _median_step(pipe, batches[6 + steps:], steps)
            fill_s = (pipe._fill.fill_seconds - fill_s0) / steps
            samples = (pipe._fill.filled_samples - n0) / steps
            rows.append((p, base, with_fill, bubble_s, fill_s, samples, job.name))
    print(f"{'ranks':>5} {'step s':>9} {'with fill':>10} {'slowdown':>9} {'bubble s/step':>14} "
          f"{'fill s/step':>12} {'converted':>10} {'samples/step':>13}")
    for p, base, fill, bub, fs, n, _ in rows:
        print(f"{p:>5} {base:>9.4f} {fill:>10.4f} {fill / base - 1:>+9.1%} {bub:>14.4f} {fs:>12.4f} "
              f"{fs / bub if bub else 0:>10.1%} {n:>13.0f}")
    return 0
