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
    p.add_argument("--steps", type=int, default=4, help="steps per round and condition")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds of plain and fill steps")
    p.add_argument("--microbatches", type=int, default=4)
    p.set_defaults(run=lambda a: run(a.ranks, a.steps, a.microbatches, a.rounds))


def _fill_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))


def _infer(batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return _FILL(batch)


_FILL = _fill_model()


def _plain_step(pipe: Pipeline, x, y) -> float:
    """A training step with the fill jobs held back (the same program, its FILL slots empty)."""
    t0 = time.perf_counter()
    pipe._run("train", x, y)
    pipe._step_count += 1
    return time.perf_counter() - t0


def _fill_step(pipe: Pipeline, x, y) -> float:
    t0 = time.perf_counter()
    pipe.step(x, y)
    return time.perf_counter() - t0


def run(ranks: list[int], steps: int, microbatches: int, rounds: int = 5) -> int:
    """Per depth: bubbles from a profiled step, then ``rounds`` alternating rounds of
    ``steps`` plain steps and ``steps`` steps with the fill job (the machine is shared and
    noisy; alternating keeps slow spells from landing on one side)."""
    from ._demo import demo_text

    vocab, batches = char_dataset(demo_text(), seq_len=32, batch_size=16, steps=2 * rounds * steps + 8)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    rows = []
    for p in ranks:
        stages = gpt_stages(cfg, num_stages=p)
        with Pipeline(stages, schedule="1f1b", num_microbatches=microbatches, loss_fn=lm_loss, device="cpu",
                      optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)) as pipe:
            for x, y in batches[:3]:  # warm-up
                _plain_step(pipe, x, y)
            raw = pipe._run("train", *batches[3], profile=True)["raw"]
            pipe._step_count += 1
            bubbles = find_bubbles(pipe._programs["train"], [[r["timeline"] for r in raw]], [0] * p, 0.0005)
            bubble_s = sum(b.seconds for b in bubbles)
            job = pipe.add_fill_job(FillJob(fn=_infer, data=[torch.randn(64) for _ in range(400_000)],
                                            name="mlp-infer"), min_bubble_s=0.0005)
            for x, y in batches[4:8]:  # places the fill slots, then probes the job's cost
                pipe.step(x, y)
            base, fill, fill_s, samples = [], [], 0.0, 0
            rest = iter(batches[8:])
            for _ in range(rounds):
                base += [_plain_step(pipe, *next(rest)) for _ in range(steps)]
                s0, n0 = pipe._fill.fill_seconds, pipe._fill.filled_samples
                fill += [_fill_step(pipe, *next(rest)) for _ in range(steps)]
                fill_s += pipe._fill.fill_seconds - s0
                samples += pipe._fill.filled_samples - n0
            n = rounds * steps
            rows.append((p, statistics.median(base), statistics.median(fill), bubble_s, fill_s / n, samples / n))
    print(f"{'ranks':>5} {'step s':>9} {'with fill':>10} {'slowdown':>9} {'bubble s/step':>14} "
          f"{'fill s/step':>12} {'converted':>10} {'samples/step':>13}")
    for p, base, fill, bub, fs, n in rows:
        print(f"{p:>5} {base:>9.4f} {fill:>10.4f} {fill / base - 1:>+9.1%} {bub:>14.4f} {fs:>12.4f} "
              f"{fs / bub if bub else 0:>10.1%} {n:>13.0f}")
    return 0
