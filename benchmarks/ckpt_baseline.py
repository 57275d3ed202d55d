"""The checkpoint path before sharding (commit 86b74e4), kept as ``bench ckpt``'s baseline.

The controller pulled each rank's ``checkpoint_state`` (one rank at a time, to bound its
memory), wrote every stage file and every RNG file itself, then the manifest, and renamed
the directory into place; loading was the mirror: the controller read each rank's stage
files and sent them to that rank's actors (``ray.put``), then each actor its RNG file.  The
files are those of the sharded format (the format did not change), so either path loads
what the other wrote.  Only the engine's public methods are used.
"""

from __future__ import annotations

import os

import ray
import torch

from actors.checkpoint_io import rng_file, stage_file

from mpmd.runtime import Engine
from mpmd.training import atomic
from mpmd.training.checkpoint import MANIFEST, check_stage_state, checked_manifest, is_checkpoint, manifest_of

__all__ = ["old_save", "old_load"]


def old_save(engine: Engine, path: str) -> str:
    """Write ``engine``'s checkpoint to ``path`` the old way: every byte through the controller."""
    engine.fleet.check_open()
    engine.fleet.quiesce()
    sched = engine.schedule
    manifest = manifest_of(engine)

    def write(tmp: str) -> None:
        what = f"saving a checkpoint to {path}"
        for rank in range(sched.num_ranks):  # one rank at a time bounds the controller's memory
            states = engine.client.checkpoint_states(indices=[rank], what=what)[0]
            for s, state in states.items():
                atomic.write_tensor_file(os.path.join(tmp, stage_file(int(s))), state)
                manifest["stage_shapes"][int(s)] = {k: list(v.shape) for k, v in state["module"].items()}
        rngs = engine.client.rng_states(what)
        for i, state in enumerate(rngs):
            atomic.write_tensor_file(os.path.join(tmp, rng_file(i)), state)
        atomic.write_json(os.path.join(tmp, MANIFEST), manifest)

    return atomic.write_atomically(path, write, is_checkpoint)


def _read(path: str):
    return torch.load(path, map_location="cpu", weights_only=True)


def old_load(engine: Engine, path: str) -> dict:
    """Restore ``engine``'s pipeline from ``path`` the old way: the controller reads every file
    and sends each rank its stages' states; returns the manifest."""
    engine.fleet.check_open()
    engine.fleet.quiesce()
    path, manifest = checked_manifest(engine, path)
    sched, cfg = engine.schedule, engine.config
    what = f"loading the checkpoint {path}"
    for rank in range(sched.num_ranks):
        states = {}
        for s in sched.stages_of(rank):
            states[s] = _read(os.path.join(path, stage_file(s)))
            check_stage_state(engine.stages, s, {k: v.shape for k, v in states[s]["module"].items()}, path)
        engine.client.load_checkpoint_states(ray.put(states), [d * sched.num_ranks + rank for d in range(cfg.layout.dp)],
                                             what)
    same_layout = (manifest["num_ranks"] == sched.num_ranks and manifest["dp"] == cfg.layout.dp
                   and manifest["stage_to_rank"] == list(sched.stage_to_rank))
    if same_layout:
        engine.client.set_rng_states([_read(os.path.join(path, rng_file(i))) for i in range(engine.num_actors)],
                                     what)
    engine.resume_at(manifest["step"])
    return manifest
