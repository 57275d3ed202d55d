"""A sweep over schedules on the same actor processes: ``mpmd.reuse_actors``.

    python examples/reuse_actors.py

Each ``mpmd.Pipeline`` normally starts its own actor processes (each imports Ray and torch:
seconds per actor on a small machine) and kills them at ``shutdown``.  Inside
``with mpmd.reuse_actors():`` a pipeline that shuts down cleanly parks its actors, and the
next pipeline rebinds them instead of starting new processes; training is bit-identical to
fresh actors (the constructor runs again, with its seed).  Ray must be started by the
script (``ray.init``): a pipeline that starts Ray itself also ends it.  Note [reused
actors] in ``mpmd/runtime/pool.py``.
"""

from __future__ import annotations

import time

import ray
import torch

import mpmd
from mpmd.cli.demo import demo_text
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss


def main() -> int:
    ray.init(num_cpus=4, include_dashboard=False)
    text = demo_text()
    cfg = GPTConfig(vocab_size=len(sorted(set(text))), seq_len=32, d_model=64, n_heads=4, n_layers=4)
    _, batches = char_dataset(text, seq_len=cfg.seq_len, batch_size=8, steps=6)
    results = []
    with mpmd.reuse_actors() as pool:
        # Two actors each time: one stage each, or two (interleaved and V-shaped schedules).
        for schedule, num_stages in (("gpipe", 2), ("1f1b", 2), ("interleaved-1f1b", 4), ("zbv", 4)):
            t0 = time.perf_counter()
            with mpmd.Pipeline(gpt_stages(cfg, num_stages=num_stages), schedule=schedule, num_microbatches=4,
                               num_actors=2, loss_fn=lm_loss, device="cpu",
                               optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3)) as pipe:
                started = time.perf_counter() - t0
                history = pipe.fit(batches, progress=False)
            results.append((schedule, started, history[-1]))
            print(f"{schedule:17s} started in {started:5.2f}s (idle actors now {len(pool)}), "
                  f"last loss {history[-1]:.3f}", flush=True)
        print(f"{pool.taken} actors reused, {pool.parked} parked")
    ray.shutdown()
    return 0 if pool.taken == 2 * (len(results) - 1) else 1


if __name__ == "__main__":
    raise SystemExit(main())
