"""PipeFill: batch inference of an independent model inside a training pipeline's bubbles.

    python examples/pipefill_inference.py            # 1f1b on 2 actors, 60 steps

The demo GPT trains with 1F1B on two actors; its bubbles (each actor's waits for the
other) run chunks of a batch-inference job: a small MLP over 50,000 inputs.  The job's
outputs come back in input order, each input processed exactly once, and the main job's
parameters are untouched by it (the fill job has its own model).  At the end the script
checks the outputs against running the MLP in this process, and prints how much of the
job got done, what it cost per sample and the pipeline's fill accounting.
"""

from __future__ import annotations

import argparse
import time

import torch

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss


def side_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))


_MODEL = None


def infer(batch: torch.Tensor) -> torch.Tensor:
    """Runs on an actor: one chunk of inputs (stacked) -> one output row per input."""
    global _MODEL
    if _MODEL is None:  # built once per actor process
        _MODEL = side_model()
    with torch.no_grad():
        return _MODEL(batch)


def bubble_use(fills) -> str:
    """The bubbles measured (per step, on each rank), those big enough to fill, and how much
    of them the fill chunks used on the steps that ran fill work."""
    waits = sum(b.seconds for b in fills.bubbles)
    usable = sum(b.seconds for b in fills.bubbles if b.seconds >= fills.min_bubble_s)
    per_step = fills.fill_seconds / max(fills.fill_steps, 1)
    share = f"{per_step / usable:.0%}" if usable else "-"
    return (f"bubbles per step (shortest wait at each of {len(fills.bubbles)} slots, all ranks): {waits * 1e3:.2f} ms, "
            f"{usable * 1e3:.2f} ms in slots of >= {fills.min_bubble_s * 1e3:g} ms; fill work used "
            f"{per_step * 1e3:.2f} ms per step ({share} of those) over {fills.fill_steps} steps")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--inputs", type=int, default=50_000)
    args = parser.parse_args()

    text = demo_text()
    vocab, batches = char_dataset(text, seq_len=32, batch_size=16, steps=args.steps)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    torch.manual_seed(1)
    samples = [torch.randn(64) for _ in range(args.inputs)]

    with mpmd.Pipeline(gpt_stages(cfg, num_stages=2), schedule="1f1b", num_microbatches=4, loss_fn=lm_loss,
                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), device="cpu") as pipe:
        job = pipe.add_fill_job(mpmd.FillJob(fn=infer, data=samples, name="mlp-inference"), policy="fifo")
        t0 = time.perf_counter()
        for step, (x, y) in enumerate(batches):
            loss = pipe.step(x, y)
            if step % 20 == 0:
                print(f"step {step:3d}  loss {loss:.3f}  fill inputs done {job.processed}/{len(samples)}")
        seconds = time.perf_counter() - t0
        print(pipe.fill_summary())
        done = job.processed
        print(bubble_use(pipe.fill_manager))
    print(f"{args.steps} training steps in {seconds:.1f} s; the bubbles processed {done} of {len(samples)} inputs")
    if job.done():
        outputs = torch.stack(job.results())
        torch.testing.assert_close(outputs, side_model()(torch.stack(samples)).detach())
        print("outputs match running the model in this process, in input order")
    else:
        print("not done yet: more training steps would finish it (job.done() says when)")


if __name__ == "__main__":
    main()
