"""ZeRO-1 under the pipeline: dp replicas split their stages' optimizer state.

    python examples/zero_dp.py            # dp=2 x 2 ranks, zero=1, AdamW; 20 steps, then a
                                          # checkpoint loaded at dp=1 (zero=0) going on alike

With ``Pipeline(..., dp=D, zero=1)`` each parameter of a rank's stages is owned by one of its
D replicas (whole parameters, balanced by bytes): after a stage's last backward its gradients
are reduce-scattered (mean) over the replicas instead of all-reduced, each replica steps the
AdamW state of the parameters it owns only, and the updated parameters go back to every
replica.  The model still equals single-process training on the global batch; each actor
holds about 1/D of the optimizer state.  Checkpoints keep one optimizer shard file per
stage and replica, and load under any dp, zero and actor layout (Note [ZeRO-1 sharding]).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss

SEQ_LEN, GLOBAL_MICROBATCHES = 32, 4


def _optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dp", type=int, default=2)
    args = parser.parse_args()
    text = demo_text()
    cfg = GPTConfig(vocab_size=len(sorted(set(text))), seq_len=SEQ_LEN, d_model=64, n_heads=4, n_layers=4)
    _, batches = char_dataset(text, seq_len=SEQ_LEN, batch_size=16, steps=args.steps + 5)
    options = dict(schedule="1f1b", loss_fn=lm_loss, optimizer=_optimizer, device="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        with mpmd.Pipeline(gpt_stages(cfg, 2), num_microbatches=GLOBAL_MICROBATCHES // args.dp, dp=args.dp, zero=1,
                           **options) as pipe:
            for i, (x, y) in enumerate(batches[:args.steps]):
                loss = pipe.step(x, y)
                if i % 5 == 0:
                    print(f"step {i:3d}  loss {loss:.4f}")
            held = pipe.engine.client.memory_bytes(what="memory")
            for i, h in enumerate(held):
                print(f"actor {i} (replica {i // pipe.num_ranks}, rank {i % pipe.num_ranks}): params "
                      f"{h['params'] / 2**10:.0f} KiB, grads kept {h['grads'] / 2**10:.0f} KiB, optimizer state "
                      f"{h['optimizer'] / 2**10:.0f} KiB")
            path = pipe.save(f"{tmp}/ck")
            sharded = [pipe.step(x, y) for x, y in batches[args.steps:]]
        # The same checkpoint on one replica without sharding continues as the run above did.
        with mpmd.Pipeline.load(path, stages=gpt_stages(cfg, 2), num_microbatches=GLOBAL_MICROBATCHES, dp=1, zero=0,
                                **options) as single:
            whole = [single.step(x, y) for x, y in batches[args.steps:]]
    print("after the checkpoint, dp=%d zero=1: %s" % (args.dp, " ".join(f"{v:.5f}" for v in sharded)))
    print("after the checkpoint, dp=1 zero=0: %s" % " ".join(f"{v:.5f}" for v in whole))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
