"""A bounded soak: a few hundred steps of a tiny model on 2 actors; the actors' resident
memory stays within 10% of its value after warm-up (buffers freed, no history kept)."""

from __future__ import annotations

import time

import ray
from torch.nn import functional as F

import mpmd

from tests.models import adamw, make_data, make_stages

WARMUP_STEPS = 50
STEPS = 300
CHUNK = 50
BUDGET_S = 60.0  # the training part; a slower machine trains fewer chunks (at least 200 steps)


def test_actor_memory_is_stable_over_a_few_hundred_steps(ray_session):
    data = make_data(10, 8)
    pipe = mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss,
                         optimizer=adamw, device="cpu")
    try:
        pipe.fit(data * (WARMUP_STEPS // len(data)), progress=False)
        baseline = ray.get([a.rss_bytes.remote() for a in pipe.actors])
        samples, done, start = [], WARMUP_STEPS, time.monotonic()
        while done < WARMUP_STEPS + STEPS and (time.monotonic() - start < BUDGET_S or done < WARMUP_STEPS + 200):
            pipe.fit(data * (CHUNK // len(data)), progress=False)
            done += CHUNK
            samples.append(ray.get([a.rss_bytes.remote() for a in pipe.actors]))
        elapsed = time.monotonic() - start
    finally:
        pipe.shutdown()

    mib = 1 << 20
    print(f"\nsoak: {done} steps ({done - WARMUP_STEPS} after warm-up, {elapsed:.1f}s)")
    for rank, base in enumerate(baseline):
        series = [s[rank] for s in samples]
        print(f"  rank {rank}: RSS after warm-up {base / mib:.1f} MiB; every {CHUNK} steps: "
              + " ".join(f"{x / mib:.1f}" for x in series)
              + f" MiB; max growth {100 * (max(series) / base - 1):+.1f}%")
        assert max(series) <= 1.10 * base, f"rank {rank}'s memory grew more than 10% after warm-up"
