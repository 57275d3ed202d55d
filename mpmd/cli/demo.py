"""The main job (``make demo``): a character-level GPT trained with interleaved 1F1B
on 2 actors of a local Ray, with a progress bar and a summary."""

from __future__ import annotations

import importlib.resources
import time

import torch

from ..models import GPTConfig, char_dataset, gpt_stages, lm_loss
from ..pipeline import Pipeline

__all__ = ["demo_text", "run_demo"]


def demo_text() -> str:
    """The text the demo and the benchmarks train on (package data)."""
    return importlib.resources.files("mpmd.cli").joinpath("data/pipeline.txt").read_text()


def run_demo(steps: int = 150, schedule: str = "interleaved-1f1b", num_actors: int = 2) -> int:
    text = demo_text()
    vocab, batches = char_dataset(text, seq_len=32, batch_size=16, steps=steps)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    stages = gpt_stages(cfg, num_stages=4)
    print(f"mpmd demo: char-level GPT ({sum(p.numel() for s in stages for p in s.parameters()):,} parameters, "
          f"4 stages) on {num_actors} actors, schedule {schedule}, {steps} steps")
    t0 = time.perf_counter()
    with Pipeline(stages, schedule=schedule, num_microbatches=4, num_actors=num_actors, loss_fn=lm_loss,
                  optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), device="cpu") as pipe:
        ready = time.perf_counter()
        history = pipe.fit(batches, tokens_per_sample=cfg.seq_len)
        trained = time.perf_counter()
        sample = _generate(pipe, vocab, prompt="The ", length=60, seq_len=cfg.seq_len)
        rpcs = pipe.last_step_rpcs
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    print(f"loss {first:.3f} -> {last:.3f} (mean of first and last 5 steps)")
    print(f"start-up {ready - t0:.1f}s, training {trained - ready:.1f}s "
          f"({len(history) / (trained - ready):.2f} steps/s), {rpcs} RPCs per step")
    print(f"greedy sample: {sample!r}")
    return 0 if last < first else 1


def _generate(pipe: Pipeline, vocab: list[str], prompt: str, length: int, seq_len: int) -> str:
    ids = [vocab.index(c) for c in prompt if c in vocab]
    for _ in range(length):
        window = ids[-seq_len:]
        x = torch.tensor([window + [0] * (seq_len - len(window))] * pipe.schedule.num_microbatches)
        logits = pipe.predict(x)
        ids.append(int(logits[0, len(window) - 1].argmax()))
    return "".join(vocab[i] for i in ids)
