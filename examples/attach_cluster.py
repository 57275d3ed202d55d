"""Attach a pipeline to a Ray cluster that is already running, and leave it running.

    ray start --head --num-cpus=4          # once, on the head machine (other machines:
                                           # ray start --address=<head-ip>:6379)
    python examples/attach_cluster.py      # address="auto": the cluster `ray start` made
    python examples/attach_cluster.py --address 10.0.0.5:6379 --placement spread
    ray stop                               # when done (stops every Ray on this machine)

The pipeline creates its actors in one placement group on the cluster and removes
both on shutdown; the cluster, and whatever else runs on it, stays up.  Every node
must be able to import mpmd (install it there, e.g. ``pip install -e .``).
"""

from __future__ import annotations

import argparse

import ray
import torch

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--address", default="auto", help='"auto", "host:port" or "ray://host:10001"')
    ap.add_argument("--placement", choices=("pack", "spread"), default="pack")
    ap.add_argument("--dp", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args(argv)

    text = demo_text()
    cfg = GPTConfig(vocab_size=len(sorted(set(text))), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    _, batches = char_dataset(text, seq_len=cfg.seq_len, batch_size=8 * args.dp, steps=args.steps)
    pipe = mpmd.Pipeline(gpt_stages(cfg, num_stages=2), schedule="1f1b", num_microbatches=4, loss_fn=lm_loss,
                         optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), dp=args.dp,
                         device="cpu", address=args.address, placement=args.placement)
    try:
        print(f"attached to a cluster of {len([n for n in ray.nodes() if n['Alive']])} node(s), "
              f"{ray.cluster_resources().get('CPU', 0):g} CPUs")
        nodes = pipe.engine.client.node_ids()
        print(f"{len(pipe.actors)} actors on {len(set(nodes))} node(s) (placement={args.placement!r})")
        history = pipe.fit(batches)
        print(f"loss {history[0]:.3f} -> {history[-1]:.3f}")
    finally:
        pipe.shutdown()  # removes the actors and their placement group; the cluster stays up
    ray.init(address=args.address, logging_level="WARNING")
    try:
        print(f"after shutdown the cluster is up with {ray.available_resources().get('CPU', 0):g} of "
              f"{ray.cluster_resources().get('CPU', 0):g} CPUs free")
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
