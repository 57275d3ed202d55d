"""Checkpoints, resuming a run, surviving a dead actor, and loading onto another layout.

    python examples/checkpoint_resume.py
"""

import os
import tempfile

import ray
import torch

import mpmd
from mpmd.training import latest_checkpoint
from mpmd.models import GPTConfig, char_dataset, gpt_stages, lm_loss

TEXT = ("A pipeline splits a model into stages; each actor runs its stages and passes activations on. "
        "Checkpoints keep the state of every stage, so a run survives a lost machine. ") * 8

vocab, batches = char_dataset(TEXT, seq_len=16, batch_size=8, steps=40)
cfg = GPTConfig(vocab_size=len(vocab), seq_len=16, d_model=32, n_heads=2, n_layers=2)


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


def new_pipeline():
    return mpmd.Pipeline(gpt_stages(cfg, num_stages=2), schedule="1f1b", num_microbatches=4, loss_fn=lm_loss,
                         optimizer=adamw, device="cpu")


ray.init(num_cpus=max(2, os.cpu_count() or 1), include_dashboard=False)  # shared by the pipelines below
run = tempfile.mkdtemp(prefix="mpmd-run-")

# 1. Train on the first 30 batches with a checkpoint every 10 steps.  At batch 15 one actor
#    is killed, as a lost machine would be: fit starts a fresh set of actors, loads
#    step-00000010 and replays batches 10..14, and the run goes on.
with new_pipeline() as pipe:
    def batches_with_a_failure():
        for i, batch in enumerate(batches[:30]):
            if i == 15:
                print(f"killing the actor of rank 1 before step {i}")
                ray.kill(pipe.actors[1])
            yield batch

    history = pipe.fit(batches_with_a_failure(), checkpoint_dir=run, checkpoint_every=10, max_restarts=1,
                       progress=False)
    print(f"part 1: {len(history)} steps, loss {history[0]:.3f} -> {history[-1]:.3f}; "
          f"checkpoints {sorted(os.listdir(run))}")

# 2. Later (a new process, here a new pipeline): the same call over all 40 batches resumes
#    from the newest complete checkpoint, skips the 30 batches it had used, trains 10 more.
with new_pipeline() as pipe:
    history = pipe.fit(batches, checkpoint_dir=run, checkpoint_every=10, progress=False)
    x, y = batches[0]
    loss = pipe.evaluate(x, y)
    print(f"part 2: resumed; {len(history)} steps in the history, loss now {history[-1]:.3f}; "
          f"newest checkpoint {os.path.basename(latest_checkpoint(run))}")

# 3. Any layout of the same stage list: both stages on one actor (an interleaved schedule
#    puts several stages per actor).  The stage modules come from code; the state from disk.
with mpmd.Pipeline.load(run, stages=gpt_stages(cfg, num_stages=2, seed=1), loss_fn=lm_loss, optimizer=adamw,
                        schedule="interleaved-1f1b", num_actors=1) as pipe:
    print(f"part 3: loaded on {len(pipe.actors)} actor; evaluation loss {pipe.evaluate(x, y):.4f} "
          f"(part 2: {loss:.4f})")

ray.shutdown()
