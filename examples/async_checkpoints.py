"""Asynchronous, sharded checkpoints: fit writes them while training goes on; a new pipeline
loads the newest (here onto another actor count) and continues exactly where the run was.

    python examples/async_checkpoints.py
"""

import os
import tempfile

import ray
import torch

import mpmd
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss
from mpmd.training import CheckpointError, latest_checkpoint

TEXT = ("Each actor writes the files of its own stages; the controller writes only the manifest. "
        "An asynchronous save returns once the actors hold a copy of their state. ") * 8

vocab, batches = char_dataset(TEXT, seq_len=16, batch_size=8, steps=30)
cfg = GPTConfig(vocab_size=len(vocab), seq_len=16, d_model=32, n_heads=2, n_layers=2)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


def new_pipeline():
    return mpmd.Pipeline(gpt_stages(cfg, num_stages=2), schedule="1f1b", num_microbatches=4, loss_fn=lm_loss,
                         optimizer=adamw, device="cpu")


ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False)  # shared by the pipelines below
run = tempfile.mkdtemp(prefix="mpmd-async-")  # one machine here; on a cluster: a filesystem every node mounts

# 1. The whole run in one go, for comparison.
with new_pipeline() as pipe:
    uninterrupted = pipe.fit(batches, progress=False)

# 2. The first 20 batches with a checkpoint every 5 steps, written in the background: each
#    actor copies its state and writes its own stages' files while the next steps run; a
#    checkpoint appears (step-00000005, ...) only once every actor has written its part.
#    fit returns with every checkpoint complete; a failed write would raise CheckpointError
#    at the next step (or at the end), and a restart would go back to the last complete one.
with new_pipeline() as pipe:
    try:
        first = pipe.fit(batches[:20], checkpoint_dir=run, checkpoint_every=5, checkpoint_async=True,
                         progress=False)
    except CheckpointError as e:
        raise SystemExit(f"a checkpoint could not be written: {e}") from None
    print(f"part 1: {len(first)} steps, loss {first[0]:.3f} -> {first[-1]:.3f}; checkpoints "
          f"{sorted(n for n in os.listdir(run) if n.startswith('step-'))}")
    # pipe.save(path, blocking=False) is the same outside fit: a PendingSave that steps go on past.
    pending = pipe.save(os.path.join(run, "extra"), blocking=False)
    pipe.step(*batches[0])  # runs while the actors write
    print(f"part 1: save(blocking=False) -> {pending!r}; written at {os.path.basename(pending.result())}")

# 3. A new pipeline (another process would do the same), built from the newest checkpoint onto
#    ONE actor (both stages there, interleaved 1F1B): the stage files load onto any layout of
#    the same stage list.  It continues with batches 20..29.  (Load warns that the actors' random
#    generators start fresh on another layout: this GPT has no dropout, so nothing differs.)
newest = latest_checkpoint(run)
with mpmd.Pipeline.load(newest, stages=gpt_stages(cfg, num_stages=2, seed=1), loss_fn=lm_loss, optimizer=adamw,
                        schedule="interleaved-1f1b", num_actors=1) as pipe:
    rest = pipe.fit(batches[20:], progress=False)
    print(f"part 2: loaded {os.path.basename(newest)} on {len(pipe.actors)} actor, trained {len(rest)} more steps")

resumed = list(first) + list(rest)
worst = max(abs(a - b) for a, b in zip(resumed, uninterrupted, strict=True))
print(f"loss after 30 steps: uninterrupted {uninterrupted[-1]:.6f}, checkpointed and resumed {resumed[-1]:.6f} "
      f"(largest difference over the 30 steps: {worst:.1e})")
ray.shutdown()
