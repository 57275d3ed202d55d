"""Data parallel x pipeline parallel: replicas of a GPT pipeline, and what dp costs.

    python examples/data_parallel.py              # dp=2 x 2 ranks = 4 actors, 40 steps
    python examples/data_parallel.py --measure    # table: dp=1 vs dp=2 step time at equal
                                                  # per-replica batch; all-reduce vs backward

Actors form a dp x ranks grid, replica-major (``pipe.actors[d * ranks + r]``).  Each
step the global batch is split across the replicas, then into microbatches; after a
stage's last backward its gradients are averaged over the replicas in flat buckets of
``bucket_bytes`` (an ``ALLREDUCE`` instruction, overlapping the other stages' cooldown),
so every replica applies the same update and the model equals single-process training
on the global batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import mpmd
import schedules
from mpmd.cli.demo import demo_text
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss

# The demo model (mpmd demo): a char-level GPT, 4 stages, interleaved 1F1B on 2 actors.
SEQ_LEN, PER_REPLICA_BATCH, MICROBATCHES = 32, 16, 4


def demo_model(num_stages: int = 4):
    text = demo_text()
    cfg = GPTConfig(vocab_size=len(sorted(set(text))), seq_len=SEQ_LEN, d_model=64, n_heads=4, n_layers=4)
    return text, cfg, gpt_stages(cfg, num_stages=num_stages)


def _optimizer(params):
    return torch.optim.AdamW(params, lr=3e-3)


def train(args) -> int:
    text, cfg, stages = demo_model(num_stages=2)
    _, batches = char_dataset(text, seq_len=cfg.seq_len, batch_size=8 * args.dp, steps=args.steps)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=lm_loss,
                       optimizer=_optimizer, dp=args.dp, device="cpu", placement="pack") as pipe:
        nodes = pipe.engine.client.node_ids()
        for i, node in enumerate(nodes):
            replica, rank = divmod(i, pipe.num_ranks)
            print(f"actor {i}: replica {replica}, rank {rank} (stage {rank}) on node {node[:8]}")
        t0 = time.perf_counter()
        history = pipe.fit(batches)
        seconds = time.perf_counter() - t0
    first, last = sum(history[:5]) / 5, sum(history[-5:]) / 5
    print(f"dp={args.dp}: global batch {8 * args.dp} (8 per replica), loss {first:.3f} -> {last:.3f}, "
          f"{len(history) / seconds:.2f} steps/s")
    return 0 if last < first else 1


def measure(args) -> int:
    """dp=1 vs dp=2 on the demo model at equal per-replica batch, from profiled steps."""
    text, cfg, stages = demo_model()
    sizes = [sum(p.numel() * p.element_size() for p in s.parameters()) for s in stages]
    largest = max(range(len(stages)), key=sizes.__getitem__)
    rows = []
    for dp, bucket in ((1, None), (2, None), (2, 0)):
        _, batches = char_dataset(text, seq_len=SEQ_LEN, batch_size=PER_REPLICA_BATCH * dp, steps=1)
        options = {} if bucket is None else {"bucket_bytes": bucket}
        with mpmd.Pipeline(stages, schedule="interleaved-1f1b", num_microbatches=MICROBATCHES, num_actors=2,
                           loss_fn=lm_loss, optimizer=_optimizer, dp=dp, device="cpu", **options) as pipe:
            report = pipe.profile(*batches[0], steps=args.steps)
        rows.append((dp, "per tensor" if bucket == 0 else "default", report, _stage_times(report, largest, dp)))
    base = statistics.median(rows[0][2].step_seconds_each)
    params = sum(p.numel() for s in stages for p in s.parameters())
    print(f"\ndemo GPT ({params:,} parameters, stage bytes {sizes}), interleaved-1f1b on 2 ranks, "
          f"{MICROBATCHES} microbatches of {PER_REPLICA_BATCH // MICROBATCHES} per replica, CPU/gloo; "
          f"median/mean over {args.steps} profiled steps")
    print(f"largest stage: {largest} ({sizes[largest] / 2**20:.2f} MiB of gradients)")
    head = ("dp", "buckets", "actors", "global batch", "step ms", "vs dp=1", f"stage {largest} B/step ms",
            "B/mb ms", "ALLREDUCE ms", "ALLREDUCE min ms", "AR / B")
    table = [head]
    for dp, buckets, report, (b_step, b_mb, ar_mean, ar_min) in rows:
        step = statistics.median(report.step_seconds_each)
        dash = dp == 1  # no all-reduce with one replica
        table.append((dp, buckets, report.num_actors, PER_REPLICA_BATCH * dp, f"{step * 1e3:.1f}",
                      f"{step / base:.2f}x", f"{b_step * 1e3:.2f}", f"{b_mb * 1e3:.2f}",
                      "-" if dash else f"{ar_mean * 1e3:.2f}", "-" if dash else f"{ar_min * 1e3:.2f}",
                      "-" if dash else f"{ar_mean / b_step:.2f}"))
    widths = [max(len(str(row[j])) for row in table) for j in range(len(head))]
    for row in table:
        print("  ".join(str(x).rjust(w) for x, w in zip(row, widths)))
    print("B/step: the stage's backward summed over its microbatches in one step (mean over replicas); "
          "ALLREDUCE: its gradient all-reduce, including any wait for the other replica to arrive; "
          "min: the replica that arrived last (closest to the transfer itself)")
    return 0


def _stage_times(report, stage: int, dp: int) -> tuple[float, float, float, float]:
    backward = defaultdict(float)  # (step, actor) -> seconds
    b_each, allreduce = [], defaultdict(list)  # step -> per-replica seconds
    for s in report.slices:
        action = schedules.Action.parse(s.name)
        if action.stage != stage:
            continue
        if s.kind in ("B", "I", "W"):
            backward[(s.step, s.actor)] += s.seconds
            b_each.append(s.seconds)
        elif s.kind == "ALLREDUCE":
            allreduce[s.step].append(s.seconds)
    b_step = statistics.mean(backward.values())
    b_mb = statistics.mean(b_each)
    if dp == 1:
        return b_step, b_mb, 0.0, 0.0
    return (b_step, b_mb, statistics.mean(x for v in allreduce.values() for x in v),
            statistics.median(min(v) for v in allreduce.values()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="training steps (40), or profiled steps (10)")
    ap.add_argument("--measure", action="store_true", help="print the dp=1 vs dp=2 table instead of training")
    args = ap.parse_args(argv)
    if args.measure:
        args.steps = args.steps or 10
        return measure(args)
    args.steps = args.steps or 40
    return train(args)


if __name__ == "__main__":
    raise SystemExit(main())
