"""Stage factories: each actor builds its own stages; the controller never holds the model.

    python examples/stage_factories.py

``mpmd.Pipeline`` takes, per stage, a module or a zero-argument factory.  A factory is
shipped instead of the module and called on every actor holding its stage, under the seed
contract: stage ``s`` is built after ``torch.manual_seed(mpmd.stage_seed(seed, s))`` (the
pipeline's ``seed`` option) under a fork of the random state.  ``mpmd.build_stages(factories,
seed=...)`` builds them here the same way, so the two pipelines below train bit for bit
alike; the factory pipeline's controller holds only the stages' structure, on the meta device.
"""

from __future__ import annotations

import os
import tempfile

import torch

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import Block, Embedding, GPTConfig, GPTStage, Head, char_dataset, lm_loss

STEPS = 6


def gpt_factories(cfg: GPTConfig) -> list:
    """Two stages of the demo GPT, as factories (no weights are created here)."""
    return [lambda: GPTStage(Embedding(cfg), Block(cfg), Block(cfg)),
            lambda: GPTStage(Block(cfg), Block(cfg), Head(cfg))]


def train(stages, batches, **options):
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=4, loss_fn=lm_loss, device="cpu",
                       optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3), seed=7, **options) as pipe:
        losses = [pipe.step(x, y) for x, y in batches]
        held = sum(p.numel() * p.element_size() for s in pipe.engine.stages for p in s.parameters() if not p.is_meta)
        return losses, pipe.state_dict(), held


def main() -> None:
    text = demo_text()
    cfg = GPTConfig(vocab_size=len(set(text)), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    _, batches = char_dataset(text, seq_len=cfg.seq_len, batch_size=16, steps=STEPS)
    factories = gpt_factories(cfg)

    losses, state, held = train(factories, batches)
    print(f"factories: losses {losses[0]:.4f} -> {losses[-1]:.4f}; the controller holds {held} parameter bytes")

    eager = mpmd.build_stages(factories, seed=7)  # here, as the actors built them
    model_bytes = sum(p.numel() * p.element_size() for s in eager for p in s.parameters())
    eager_losses, eager_state, _ = train(eager, batches)
    same = eager_losses == losses and all(torch.equal(v, state[k]) for k, v in eager_state.items())
    print(f"eager stages ({model_bytes / 2**20:.2f} MiB built on the controller): "
          f"{'bit-identical' if same else 'DIFFERENT'} losses and parameters")
    assert same

    with tempfile.TemporaryDirectory() as tmp:  # a checkpoint loads into a factory pipeline
        with mpmd.Pipeline(factories, schedule="1f1b", num_microbatches=4, loss_fn=lm_loss, device="cpu") as pipe:
            pipe.load_state_dict(state)
            path = pipe.save(os.path.join(tmp, "ckpt"))
        with mpmd.Pipeline.load(path, stages=gpt_factories(cfg), loss_fn=lm_loss) as pipe:
            x, y = batches[-1]
            print(f"reloaded from factories: evaluate {pipe.evaluate(x, y):.4f}")


if __name__ == "__main__":
    main()
