"""A bounded soak: a few hundred steps of a small model on 2 actors; the actors' resident
memory may grow by at most ``TOLERANCE_MIB`` after warm-up (buffers freed, no history kept).

What it catches: each actor's stage outputs over one step (the activations that cross a
stage boundary: stage 0's hidden state on rank 0, stage 1's output on rank 1) are
``BATCH x WIDTH`` float32 = 64 x 512 x 4 B = 128 KiB.  Kept every step, that is
128 KiB x 300 steps = 37.5 MiB after warm-up, three times the 12 MiB tolerance: any leak
of more than 12 MiB / 300 = 41 KiB per step (a third of one step's activations) fails.
In practice RSS grows several times the bytes kept (the kept tensors fragment the heap):
a stage keeping every output grew by 150-230 MiB, one keeping 1 in 8 (16 KiB per step)
by 14-22 MiB, both failing; without a leak the growth stays under ~2 MiB.
"""

from __future__ import annotations

import ray
from torch.nn import functional as F

import mpmd

from tests.models import make_data, make_stages, sgd

WARMUP_STEPS = 50
STEPS = 300
CHUNK = 50
BATCH = 64
WIDTH = 512  # input, hidden and output width
TOLERANCE_MIB = 12.0
ACTIVATION_BYTES_PER_STEP = BATCH * WIDTH * 4  # one actor's stage outputs over one step
assert ACTIVATION_BYTES_PER_STEP * STEPS > 3 * TOLERANCE_MIB * 2**20  # a third of them per step shows


def soak(stages) -> tuple[list[int], list[list[int]]]:
    """RSS of each actor after warm-up (the highest of its last 3 samples), and every ``CHUNK`` steps after that."""
    data = make_data(10, BATCH, d_in=WIDTH, d_out=WIDTH)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu") as pipe:
        warm = []  # RSS swings by a few MiB from sample to sample: the baseline is the top of the swing
        for _ in range(WARMUP_STEPS // len(data)):
            pipe.fit(data, progress=False)
            warm.append(ray.get([a.rss_bytes.remote() for a in pipe.actors]))
        baseline = [max(s[rank] for s in warm[-3:]) for rank in range(len(pipe.actors))]
        samples = []
        for _ in range(STEPS // CHUNK):
            pipe.fit(data * (CHUNK // len(data)), progress=False)
            samples.append(ray.get([a.rss_bytes.remote() for a in pipe.actors]))
    return baseline, samples


def test_actor_memory_is_stable_over_a_few_hundred_steps(ray_session):
    baseline, samples = soak(make_stages(2, d_in=WIDTH, d=WIDTH, d_out=WIDTH))
    mib = 1 << 20
    print(f"\nsoak: {STEPS} steps after {WARMUP_STEPS} of warm-up")
    for rank, base in enumerate(baseline):
        series = [s[rank] for s in samples]
        growth = (max(series) - base) / mib
        print(f"  rank {rank}: RSS after warm-up {base / mib:.1f} MiB; every {CHUNK} steps: "
              + " ".join(f"{x / mib:.1f}" for x in series) + f" MiB; max growth {growth:+.2f} MiB")
        assert growth <= TOLERANCE_MIB, f"rank {rank}'s memory grew {growth:.1f} MiB after warm-up"
