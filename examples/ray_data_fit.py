"""Feeding a pipeline from Ray Data: the actors pull their own rows, the controller only counts steps.

    python examples/ray_data_fit.py            # dp=1: fit(ds) next to fit on the same rows as tensors
    python examples/ray_data_fit.py --dp 2     # two replicas, each reading its own streaming_split

The demo's char-level GPT (4 stages, interleaved 1F1B on 2 actors) trains on a
``ray.data.Dataset`` of rows ``{"tokens": int64[seq], "next": int64[seq]}``.  In each
replica the actor of the first stage pulls ``batch_size / dp`` rows per step from its
``streaming_split`` iterator, cuts them into microbatches and sends the ``next`` column to
the actor of the last stage; the controller's step calls carry no data (each actor gets the
same few-byte message: "payload-free" below).  With dp=1 the losses equal those of ``fit`` on the same rows as
tensors, bit for bit.
"""

from __future__ import annotations

import argparse

import ray
import ray.data
import torch

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss

SEQ_LEN, BATCH, MICROBATCHES, STEPS = 32, 16, 4, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=1)
    args = parser.parse_args()
    ray.init(num_cpus=2 * args.dp + 2, include_dashboard=False, log_to_driver=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    text = demo_text()
    vocab, batches = char_dataset(text, SEQ_LEN, BATCH, STEPS)
    rows = [{"tokens": x.numpy(), "next": y.numpy()} for inputs, targets in batches for x, y in zip(inputs, targets)]
    ds = ray.data.from_items(rows)  # a real job would read files: ray.data.read_parquet(...)
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=SEQ_LEN, d_model=64, n_heads=4, n_layers=4)

    def pipeline() -> mpmd.Pipeline:
        return mpmd.Pipeline(gpt_stages(cfg, num_stages=4), schedule="interleaved-1f1b", num_actors=2, dp=args.dp,
                             num_microbatches=MICROBATCHES, loss_fn=lm_loss, device="cpu",
                             optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3))

    with pipeline() as pipe:
        fed = pipe.fit(ds, batch_size=BATCH, columns=("tokens", "next"), log_every=10)
        stats = pipe.engine.last_dispatch
        print(f"fit(ds): {len(fed)} steps, loss {fed[0]:.3f} -> {fed[-1]:.3f}; the last step's calls: "
              f"{stats.rpcs} messages, {stats.bare} of them payload-free")
    if args.dp == 1:
        with pipeline() as pipe:
            plain = pipe.fit(batches, log_every=10)
        print(f"fit on the same rows as tensors: loss {plain[0]:.3f} -> {plain[-1]:.3f}; "
              f"equal to fit(ds) bit for bit: {list(plain) == list(fed)}")
    ray.shutdown()


if __name__ == "__main__":
    main()
