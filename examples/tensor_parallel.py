"""Tensor parallelism inside the pipeline's stages: a tiny Hugging Face Llama (built from a
config: nothing is downloaded) split into 2 stages, each stage sharded over 2 actors.

    pip install 'mpmd[hf]'
    python examples/tensor_parallel.py [--steps 8]    # pp=2 x tp=2 = 4 actors, 1F1B

With ``Pipeline(stages, tp=2, tp_plan="auto")`` every pipeline rank is a group of 2 actors
holding DTensor shards of its stage (``parallelize_module`` over the group's DeviceMesh):
attention q/k/v column-wise and o row-wise, MLP gate/up column-wise and down row-wise, the
embedding vocabulary-parallel, the LM head column-wise with its logits gathered.  The
values between stages stay whole: TP rank t sends to TP rank t of the next stage.  Each
actor holds about half of its stage's parameters (the RMSNorm weights stay whole), and
``pipe.state_dict()`` gathers whole tensors under the model's own keys, so the trained
weights load straight back into the ``transformers`` model.
"""

from __future__ import annotations

import argparse

import torch
import transformers

import mpmd
from mpmd.planning import causal_lm_loss

VOCAB, SEQ_LEN, BATCH, MICROBATCHES = 128, 16, 8, 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs reserved per actor")
    args = ap.parse_args(argv)

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=SEQ_LEN, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    stages = mpmd.split(model, num_stages=2)  # embeddings + layers 0-1 | layers 2-3 + norm + head
    g = torch.Generator().manual_seed(0)
    # Random tokens, the same 2 batches over and over: the loss must fall.
    data = [torch.randint(0, VOCAB, (BATCH, SEQ_LEN), generator=g) for _ in range(2)]
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, tp=2, tp_plan="auto",
                       loss_fn=causal_lm_loss, device="cpu", num_cpus=args.num_cpus,
                       optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3)) as pipe:
        print(f"{len(pipe.actors)} actors: {pipe.num_ranks} pipeline ranks x tp=2, schedule {pipe.schedule.name}")
        losses = []
        for i in range(args.steps):
            ids = data[i % len(data)]
            losses.append(pipe.step(ids, ids))  # causal_lm_loss shifts the labels itself
            print(f"step {i:2d}  loss {losses[-1]:.4f}")
        held = pipe.engine.client.memory_bytes(what="memory")
        for i, h in enumerate(held):
            print(f"actor {i} (pipeline rank {i // 2}, TP rank {i % 2}): params {h['params'] / 2**10:.1f} KiB, "
                  f"optimizer state {h['optimizer'] / 2**10:.1f} KiB")
        print(f"params over all actors {sum(h['params'] for h in held) / 2**10:.1f} KiB; "
              f"the whole model {whole / 2**10:.1f} KiB")
        state = pipe.state_dict()  # whole tensors, the model's own keys
    model.load_state_dict(state)  # strict: every key, every shape
    with torch.no_grad():
        ids = data[0]
        hf_loss = torch.stack([causal_lm_loss(model(x).logits, x) for x in ids.chunk(MICROBATCHES)]).mean().item()
    print(f"state_dict() loaded into the transformers model: its loss on batch 0 is {hf_loss:.4f} "
          f"(first step's {losses[0]:.4f})")
    return 0 if losses[-1] < losses[0] and hf_loss < losses[0] else 1


if __name__ == "__main__":
    raise SystemExit(main())
