"""A Hugging Face causal LM trained as a pipeline: a tiny Llama-family model with tied
input/output embeddings (built from a config: nothing is downloaded), split by
``mpmd.split`` into 4 stages on 2 actors with ZB-V, trained on the shipped text with an
attention mask as a side input, then saved with ``save_pretrained`` and reloaded into a
plain ``transformers`` model whose loss matches the pipeline's.

    pip install 'mpmd[hf]'
    python examples/hf_causal_lm.py [--steps 60]
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import transformers

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import char_dataset
from mpmd.planning import causal_lm_loss


def padded(ids: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Sequences of different lengths, right-padded: the mask says which tokens are real,
    padding is left out of the loss (-100)."""
    lengths = torch.randint(ids.shape[1] // 2, ids.shape[1] + 1, (ids.shape[0],), generator=generator)
    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
    return ids, ids.masked_fill(mask == 0, -100), {"attention_mask": mask}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args(argv)

    vocab, batches = char_dataset(demo_text(), seq_len=32, batch_size=8, steps=args.steps)
    g = torch.Generator().manual_seed(0)
    data = [padded(x, g) for x, _ in batches]
    config = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    stages = mpmd.split(model, num_stages=4)  # embeddings + layer 0 | layer 1 | layer 2 | layer 3 + norm + head
    with mpmd.Pipeline(stages, schedule="zbv", num_microbatches=4, loss_fn=causal_lm_loss, device="cpu",
                       optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3)) as pipe:
        print(f"tied embeddings: stages {[t.stages for t in pipe.engine.ties]} share "
              f"{sum(len(t.names[t.stages[0]]) for t in pipe.engine.ties)} parameter(s); "
              f"{len(pipe.actors)} actors, schedule {pipe.schedule.name}")
        history = pipe.fit(data)
        ids, labels, side = data[0]
        pipe_loss = pipe.evaluate(ids, labels, **side)
        state = pipe.state_dict()  # the model's own keys
    print(f"loss {sum(history[:5]) / 5:.3f} -> {sum(history[-5:]) / 5:.3f} (mean of first and last 5 steps)")

    model.load_state_dict(state)
    with tempfile.TemporaryDirectory() as path:
        model.save_pretrained(path)
        reloaded = transformers.LlamaForCausalLM.from_pretrained(path)
    with torch.no_grad():
        losses = [causal_lm_loss(reloaded(x, attention_mask=m).logits, y)
                  for x, y, m in zip(ids.chunk(4), labels.chunk(4), side["attention_mask"].chunk(4), strict=True)]
    hf_loss = torch.stack(losses).mean().item()
    print(f"evaluation loss: pipeline {pipe_loss:.6f}, reloaded transformers model {hf_loss:.6f}")
    return 0 if abs(pipe_loss - hf_loss) <= 1e-5 * abs(hf_loss) and history[-1] < history[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
