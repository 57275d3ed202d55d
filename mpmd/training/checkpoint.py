"""Checkpoints: ``Pipeline.save`` / ``Pipeline.load``, and ``fit``'s resume and restarts.

A checkpoint is a directory::

    manifest.json     written last: a directory without it is not a checkpoint
    stage-0000.pt     per stage: {"module": state_dict, "optimizer": state_dict or None}
    rng-0000.pt       per actor (rank order, replica-major): its torch RNG states

State is kept per *stage* (each stage has its own optimizer on its actor), so a
checkpoint loads on any number of actors for the same stage list; RNG states are per
actor and are restored only onto the same layout.  The manifest also keeps the options
that rebuild the pipeline (``mpmd.Pipeline.load``), among them those of its batching
strategy (TeraPipe's sequence microbatches and token slices).  ``save`` writes into a temporary
sibling directory, fsyncs it and renames it into place (Note [atomic checkpoint]); every
file loads with ``torch.load(weights_only=True)``.

``fit(..., checkpoint_dir=d, checkpoint_every=n)`` writes ``d/step-00000010`` and so on;
``resume=True`` continues from the newest complete one (skipping the batches it had
consumed), and ``max_restarts=k`` replaces dead actors with a fresh set and goes on from
the last checkpoint, replaying the batches consumed since.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import json
import os
import re
import shutil
import tempfile
import time
import types
import uuid
from typing import Any, Callable, Optional

import ray
import torch

import schedules

from ..runtime import Engine, PipelineConfig
from ..runtime.checks import warn_user

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "is_checkpoint", "read_manifest",
           "checkpoint_name", "checkpoint_arguments", "FORMAT"]

FORMAT = "mpmd-checkpoint/1"
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_OLD_STEP_DIR = re.compile(r"^\.step-(\d+)\.old-")  # Note [atomic checkpoint]

# Note [atomic checkpoint]
# Files go into ".NAME.tmp-*" next to NAME, each fsynced; the manifest is written last,
# the directory fsynced and renamed to NAME, then the parent fsynced.  A crash before the
# rename leaves only the temporary directory (ignored by readers, removed by the next
# save of NAME); overwriting an existing NAME moves it to ".NAME.old-*" first, and readers
# fall back to that if the crash came between the two renames.


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def latest_checkpoint(root: str) -> Optional[str]:
    """``root`` if it is a checkpoint, else its complete ``step-N`` subdirectory with the largest N."""
    root = os.fspath(root)
    if is_checkpoint(root):
        return root
    if not os.path.isdir(root):
        return _fallback(root)
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name) or _OLD_STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and is_checkpoint(path):
            found.append((int(m.group(1)), not name.startswith("."), path))  # step-N before its .old copy
    return max(found)[2] if found else None


def _fallback(path: str) -> Optional[str]:
    """The checkpoint a crash between the two renames of an overwrite left at ``.NAME.old-*``."""
    parent, name = os.path.split(os.path.abspath(path))
    olds = [p for p in glob.glob(os.path.join(parent, f".{name}.old-*")) if is_checkpoint(p)]
    return max(olds, key=os.path.getmtime) if olds else None


def read_manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST)) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} is not an mpmd checkpoint of format {FORMAT!r} (got {manifest.get('format')!r})")
    return manifest


def _resolve(path: str) -> str:
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint at {os.fspath(path)!r}: a checkpoint is a directory holding "
                                f"{MANIFEST} (written by pipe.save), or a directory of step-N checkpoints (fit)")
    return found


# -- writing ---------------------------------------------------------------------------------------
def save_checkpoint(engine: Engine, path: str, *, fit_state: Optional[dict] = None) -> str:
    """Write the checkpoint of ``engine``'s pipeline to the directory ``path`` atomically; returns the path."""
    engine.check_open()
    engine.quiesce()  # the state after every step issued
    sched, cfg = engine.schedule, engine.config
    manifest = {
        "format": FORMAT,
        "step": engine.step_count,
        "num_stages": sched.num_stages,
        "stage_classes": [type(m).__qualname__ for m in engine.stages],
        "schedule": sched.name,
        "num_ranks": sched.num_ranks,
        "dp": cfg.dp,
        "stage_to_rank": list(sched.stage_to_rank),
        "config": _config_dict(cfg),
        "batching": engine.batching.checkpoint_options(),  # overrides config and schedule on load
        "stage_shapes": [None] * sched.num_stages,  # per stage {key: shape}: checked before loading
        "fit": fit_state,
        "torch": torch.__version__,
        "saved_at": time.time(),
    }

    def write(tmp: str) -> None:
        what = f"saving a checkpoint to {path}"
        for rank in range(sched.num_ranks):  # one rank at a time bounds the controller's memory
            states = engine.call_actors("checkpoint_state", what=what, indices=[rank])[0]
            for s, state in states.items():
                _write_tensor_file(os.path.join(tmp, f"stage-{int(s):04d}.pt"), state)
                manifest["stage_shapes"][int(s)] = {k: list(v.shape) for k, v in state["module"].items()}
        rngs = engine.call_actors("rng_state", what=what)
        for i, state in enumerate(rngs):
            _write_tensor_file(os.path.join(tmp, f"rng-{i:04d}.pt"), state)
        _write_json(os.path.join(tmp, MANIFEST), manifest)

    return _write_atomically(path, write)


def _write_atomically(path: str, write: Callable[[str], None]) -> str:
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)
    try:
        write(tmp)
        _fsync_dir(tmp)
        if os.path.lexists(path):
            old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
        _fsync_dir(parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _write_tensor_file(path: str, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _config_dict(cfg: PipelineConfig) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if v is None or isinstance(v, (bool, int, float, str)):
            out[f.name] = v
    return out


# -- reading ---------------------------------------------------------------------------------------
def _read_tensor_file(path: str) -> Any:
    return torch.load(path, map_location="cpu", weights_only=True)


def load_checkpoint(engine: Engine, path: str) -> dict:
    """Restore ``engine``'s pipeline (its actors running) from the checkpoint at ``path``; returns the manifest."""
    engine.check_open()
    engine.quiesce()
    path = _resolve(path)
    manifest = read_manifest(path)
    sched, cfg = engine.schedule, engine.config
    if manifest["num_stages"] != sched.num_stages:
        raise ValueError(f"the checkpoint {path} has {manifest['num_stages']} stages but this pipeline has "
                         f"{sched.num_stages}; load it with the same stage list")
    for s, shapes in enumerate(manifest["stage_shapes"]):  # before anything is sent
        _check_stage_state(engine.stages, s, shapes, path)
    what = f"loading the checkpoint {path}"
    for rank in range(sched.num_ranks):
        states = {}
        for s in sched.stages_of(rank):
            states[s] = _read_tensor_file(os.path.join(path, f"stage-{s:04d}.pt"))
            _check_stage_state(engine.stages, s, {k: v.shape for k, v in states[s]["module"].items()}, path)
        engine.call_actors("load_checkpoint_state", ray.put(states), what=what,
                           indices=[d * sched.num_ranks + rank for d in range(cfg.dp)])
    same_layout = (manifest["num_ranks"] == sched.num_ranks and manifest["dp"] == cfg.dp
                   and manifest["stage_to_rank"] == list(sched.stage_to_rank))
    if same_layout:
        futs = {a.set_rng_state.remote(_read_tensor_file(os.path.join(path, f"rng-{i:04d}.pt"))): i
                for i, a in enumerate(engine.actors)}
        engine.wait(list(futs), what, owner=futs)
    else:
        warn_user(f"the checkpoint {path} was written on {manifest['num_ranks']} ranks x dp={manifest['dp']} "
                  f"with stage -> rank {manifest['stage_to_rank']}; this pipeline runs {sched.num_ranks} ranks x "
                  f"dp={cfg.dp} with stage -> rank {list(sched.stage_to_rank)}, so the actors' random number "
                  f"generators start fresh (dropout masks will differ)")
    engine.step_count = int(manifest["step"])
    return manifest


def _check_stage_state(stages, s: int, saved: dict, path: str) -> None:
    """``saved``: {key: shape} of stage ``s`` in the checkpoint, against the given module."""
    expected = stages[s].state_dict()
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    wrong = [f"{k}: saved {tuple(saved[k])}, module {tuple(v.shape)}" for k, v in expected.items()
             if k in saved and tuple(saved[k]) != tuple(v.shape)]
    if missing or unexpected or wrong:
        raise ValueError(f"the checkpoint {path} does not fit stage {s} ({type(stages[s]).__name__}): missing keys "
                         f"{missing[:5]}, unexpected keys {unexpected[:5]}, shape mismatches {wrong[:5]}; "
                         f"pass the stage list the checkpoint was written from")


def checkpoint_arguments(path: str, overrides: dict) -> tuple[str, dict]:
    """``(checkpoint path, Pipeline options)`` that rebuild the pipeline saved at ``path``
    (``mpmd.Pipeline.load``): the saved configuration and batching strategy (e.g. TeraPipe's
    token slices), then ``overrides``.  The options include ``schedule`` and ``num_microbatches``."""
    path = _resolve(path)
    manifest = read_manifest(path)
    known = {f.name for f in dataclasses.fields(PipelineConfig)}
    options = {k: v for k, v in manifest["config"].items() if k in known}
    options["schedule"] = manifest["schedule"]
    options.update(manifest.get("batching") or {})
    options.update(overrides)
    schedule = options["schedule"]
    if isinstance(schedule, str) and schedule not in schedules.schedule_names() and "schedule" not in overrides \
            and "token_slices" not in options:
        raise ValueError(f"the checkpoint {path} was written with the schedule {schedule!r}, which is not a "
                         f"registered name; pass schedule=... to Pipeline.load")
    return path, options


class class_or_instance_method:
    """A method that gets the instance when called on one and the class when called on the
    class: ``pipe.load(path)`` restores a running pipeline, ``Pipeline.load(path, ...)``
    builds one."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    def __get__(self, obj, cls):
        return types.MethodType(self.fn, cls if obj is None else obj)
