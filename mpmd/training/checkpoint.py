"""Checkpoints: ``Pipeline.save`` / ``Pipeline.load``, and ``fit``'s resume and restarts.

A checkpoint is a directory::

    manifest.json     written last: a directory without it is not a checkpoint
    stage-0000.pt     per stage: {"module", "optimizer", "scheduler", "loss_scale"} state dicts
    optim-0000-0001.pt  under zero=1, per stage and replica (with cp > 1, per replica and CP
                      rank, numbered replica x cp + CP rank): its shard of the stage's
                      optimizer state, by parameter name (Note [resharding])
    rng-0000.pt       per actor (rank order, replica-major): its torch RNG states
    stage-0000.tp-0001.pt, optim-0000-0001.tp-0001.pt  under tp > 1: TP rank 1's pieces of
                      the stage's sharded tensors (Note [checkpoint pieces] in actors/pieces.py)
    stage-0000.ep-0001.pt  under ep > 1: EP rank 1's (member 1's) experts and their optimizer state, as
                      pieces of the whole tensors (Note [expert pieces] in actors/expert_state.py)

State is kept per *stage* (each stage has its own optimizer on its actor), so a
checkpoint loads on any number of actors for the same stage list; RNG states are per
actor and are restored only onto the same layout.  The manifest also keeps the options
that rebuild the pipeline (``mpmd.Pipeline.load``), among them those of its batching
strategy (TeraPipe's sequence microbatches and token slices).  ``save`` writes into a temporary
sibling directory, fsyncs it and renames it into place (Note [atomic checkpoint]); every
file loads with ``torch.load(weights_only=True)``.

The actors write and read the stage and RNG files themselves, all at once (Note [sharded
checkpoint]), so the checkpoint's path must be one the actors can reach under the same
name: a filesystem every node mounts there, or a single node.  ``save(path,
blocking=False)`` returns once the actors hold a copy of their state, and the checkpoint
appears when it is written (Note [asynchronous save]).

``fit(..., checkpoint_dir=d, checkpoint_every=n)`` writes ``d/step-00000010`` and so on;
``resume=True`` continues from the newest complete one (skipping the batches it had
consumed), and ``max_restarts=k`` replaces dead actors with a fresh set and goes on from
the last checkpoint, replaying the batches consumed since.
"""

from __future__ import annotations

import functools
import os
import re
import time
import types
from typing import Callable, Optional, Union

import torch

import schedules
from actors.checkpoint_io import ShardReport, is_marker

from ..runtime import Engine
from ..runtime.checks import warn_user
from . import atomic
from .async_save import CheckpointError, PendingSave, abandon_save, raise_failed_save, track, wait_for_save
from .manifest import (FORMAT, MANIFEST, RESTORED_OPTIONS, UnreadableCheckpointError, read_manifest,
                       restored_options, saved_options)

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "is_checkpoint", "read_manifest",
           "checkpoint_name", "checkpoint_arguments", "manifest_of", "checked_manifest", "check_stage_state",
           "FORMAT", "MANIFEST", "RESTORED_OPTIONS", "UnreadableCheckpointError", "checkpoints_newest_first",
           "CheckpointError", "PendingSave", "raise_failed_save", "finish_saves", "abandon_save"]

_STEP_DIR = re.compile(r"^step-(\d+)$")
_OLD_STEP_DIR = re.compile(r"^\.step-(\d+)\.old-")  # Note [atomic checkpoint]

# Note [atomic checkpoint]
# Files go into ".NAME.tmp-*" next to NAME, each fsynced; the manifest is written last,
# the directory fsynced and renamed to NAME, then the parent fsynced.  A crash before the
# rename leaves only the temporary directory (ignored by readers, removed by the next
# save of NAME); overwriting an existing NAME moves it to ".NAME.old-*" first, and readers
# fall back to that if the crash came between the two renames.  (atomic.py)
#
# Note [sharded checkpoint]
# The controller makes the temporary directory and asks every actor at once
# (``save_shard``) to write its shard there: the files of its stages (the first replica
# only: replicas hold the same state; a tied parameter is in each of its stages' files; under
# TP each TP rank its own pieces of them, Note [checkpoint pieces]; under EP the first ``ep``
# of a rank's dp x cp members, each its experts' pieces, Note [expert pieces]) and its own RNG file
# (actors/checkpoint_io.py).  Each answers with the shapes of its stages'
# module states, or with what failed, naming itself, the stage and the file; an actor
# never raises for a failed write, so a full disk fails the save, not the pipeline.  Only
# when every shard is written does the controller write the manifest (with those shapes)
# and rename the directory (Note [atomic checkpoint]); otherwise it removes it and raises
# ``CheckpointError``.  Loading is the mirror: the controller reads the manifest and checks
# its shapes against the stage modules before anything is sent; each actor reads the files
# of the stages it now owns (and its RNG file, on the same layout) and holds them
# (``read_shard``); the controller checks the shapes each read and only then has every
# actor load what it read (``apply_shard``), or drop it.  The controller moves no tensors.
#
# Note [resharding]
# Under ZeRO-1 (Note [ZeRO-1 sharding] in actors/zero.py) a stage's optimizer state is split by
# whole parameters over its replicas (and CP ranks: the rank's dp x cp actors, numbered as
# ``DeviceGrid.reduce_index``), so every one of them writes its own shard,
# ``optim-SSSS-RRRR.pt`` ({"state": {parameter name: state}, "param_groups": [hyperparameters,
# "params": names]}), and the stage file says how many (``"optimizer_shards"``).  An actor
# loading a stage reads every shard of it, merges them by name and keeps what it steps now:
# everything (zero=0), or the parameters it owns under the new dp; a zero=0 checkpoint's
# positional state is named through the optimizer's own order.  So a checkpoint loads under
# any dp, zero and actor layout.  Experts (ep > 1) are the exception that slices: their state is
# not in these shards but beside their weights in the stage files, as pieces of the whole
# tensors that each actor cuts its expert range from (Note [expert pieces] in
# actors/expert_state.py), so any ep loads them too.  ``torch.distributed.checkpoint`` is not used: whole-parameter
# shards are never sliced, so resharding is renaming, which needs none of its planning; its
# save and load are collectives over a process group, which here would run on the world group
# the pipeline's own traffic uses (and, for an asynchronous save, from a writer thread while
# steps go on); and the per-stage files, shapes in the manifest and atomic rename stay as
# they are.
#
# Note [asynchronous save]
# ``blocking=False``: after the steps issued so far, each actor copies its state into host
# memory under its lock and returns at once; a writer thread writes the copy, without the
# lock (steps go on), then leaves ``.done-NNNN`` or ``.failed-NNNN`` (the error) in the
# temporary directory.  A ``PendingSave`` (async_save.py) watches the directory in a
# controller thread and asks the actors still writing now and then whether they live; when
# every marker is "done" it removes the markers, writes the manifest and renames.  At most
# one save is in flight: the next save (or load) waits for it.  A failure is raised once: by
# ``PendingSave.result()``, else at the next step (``raise_failed_save``), save, load, or at
# the end of ``fit``.  The copy costs each actor its state's size in host memory while it is
# written.


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def latest_checkpoint(root: str) -> Optional[str]:
    """``root`` if it is a checkpoint, else its complete ``step-N`` subdirectory with the largest N."""
    found = checkpoints_newest_first(root)
    return found[0] if found else None


def checkpoints_newest_first(root: str) -> list[str]:
    """``[root]`` if it is a checkpoint, else its complete ``step-N`` subdirectories (and the
    ``.old`` copies a crash left, Note [atomic checkpoint]), the largest N first."""
    root = os.fspath(root)
    if is_checkpoint(root):
        return [root]
    if not os.path.isdir(root):
        old = atomic.fallback(root, is_checkpoint)
        return [old] if old is not None else []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name) or _OLD_STEP_DIR.match(name)
        path = os.path.join(root, name)
        if m and is_checkpoint(path):
            found.append((int(m.group(1)), not name.startswith("."), path))  # step-N before its .old copy
    return [path for *_, path in sorted(found, reverse=True)]


def _resolve(path: str) -> str:
    found = latest_checkpoint(path)
    if found is None:
        raise FileNotFoundError(f"no complete checkpoint at {os.fspath(path)!r}: a checkpoint is a directory holding "
                                f"{MANIFEST} (written by pipe.save), or a directory of step-N checkpoints (fit)")
    return found


# -- writing ---------------------------------------------------------------------------------------
def manifest_of(engine: Engine, fit_state: Optional[dict] = None) -> dict:
    """The manifest of ``engine``'s pipeline now; ``stage_shapes`` are filled in by the save."""
    sched, cfg = engine.schedule, engine.config
    return {
        "format": FORMAT,
        "step": engine.step_count,
        "num_stages": sched.num_stages,
        "stage_classes": [type(m).__qualname__ for m in engine.stages],
        "schedule": sched.name,
        "num_ranks": sched.num_ranks,
        "dp": cfg.layout.dp,
        "ep": cfg.layout.ep,  # the stage files' "ep_parts" say how each stage was written; any ep loads them
        "stage_to_rank": list(sched.stage_to_rank),
        "config": saved_options(cfg, sched),
        "batching": engine.batching.checkpoint_options(),  # overrides config and schedule on load
        "stage_shapes": [None] * sched.num_stages,  # per stage {key: shape}: checked before loading
        "model_keys": engine.state_keys.model_keys,  # the stages' keys are the model's own (mpmd export)
        "fit": fit_state,
        "torch": torch.__version__,
        "saved_at": time.time(),
    }


def save_checkpoint(engine: Engine, path: str, *, fit_state: Optional[dict] = None,
                    blocking: bool = True) -> Union[str, PendingSave]:
    """Write the checkpoint of ``engine``'s pipeline, after every step issued, to the directory
    ``path`` atomically (Note [sharded checkpoint]); returns the path.  ``blocking=False``
    returns a ``PendingSave`` once the actors hold a copy of their state (Note [asynchronous
    save]).  A failed write raises ``CheckpointError`` naming the actor and the stage."""
    wait_for_save(engine)  # at most one in flight; its failure, if nobody had it, is raised here
    engine.fleet.check_open()
    engine.fleet.quiesce()  # the state after every step issued
    manifest = manifest_of(engine, fit_state)
    path, tmp = atomic.begin(path, is_checkpoint)  # Note [save replaces only a checkpoint] in atomic.py
    try:
        replies = engine.client.save_shards(tmp, blocking, f"saving a checkpoint to {path}")
    except BaseException:
        atomic.abort(tmp)
        raise
    reports = [ShardReport._make(r) for r in replies]
    for report in reports:
        for s, shapes in report.shapes.items():
            manifest["stage_shapes"][int(s)] = shapes
    errors = [r.error for r in reports if r.error]
    finish = functools.partial(_finish, tmp, path, manifest)
    if errors:
        failure = _save_failure(path, errors)
        if not blocking:  # the writers that did start end before their directory goes
            PendingSave(engine, path, tmp, [r.index for r in reports if not r.error], _raiser(failure)).wait()
        atomic.abort(tmp)
        raise failure
    if not blocking:
        pending = PendingSave(engine, path, tmp, [r.index for r in reports], finish)
        track(engine, pending)
        return pending
    try:
        return finish()
    except BaseException:
        atomic.abort(tmp)
        raise


def _finish(tmp: str, path: str, manifest: dict) -> str:
    """Every shard is written: the markers go, the manifest comes, the directory is renamed."""
    for name in os.listdir(tmp):
        if is_marker(name):
            os.remove(os.path.join(tmp, name))
    atomic.write_json(os.path.join(tmp, MANIFEST), manifest)
    return atomic.commit(tmp, path, is_checkpoint)


def _save_failure(path: str, errors: list[str]) -> CheckpointError:
    more = f" (and {len(errors) - 1} more: {'; '.join(errors[1:])})" if len(errors) > 1 else ""
    return CheckpointError(f"saving the checkpoint {path} failed: {errors[0]}{more}; nothing was written at "
                           f"{path} (a checkpoint there before is intact)", path=path)


def _raiser(error: BaseException) -> Callable[[], None]:
    def finish() -> None:
        raise error
    return finish


def finish_saves(engine: Engine) -> None:
    """Wait for ``engine``'s asynchronous save in flight, if any, and raise its failure if it
    has not been raised (``Pipeline.shutdown`` calls it before stopping the actors)."""
    wait_for_save(engine)


# -- reading ---------------------------------------------------------------------------------------
def load_checkpoint(engine: Engine, path: str) -> dict:
    """Restore ``engine``'s pipeline (its actors running) from the checkpoint at ``path``; returns the manifest."""
    wait_for_save(engine)
    engine.fleet.check_open()
    engine.fleet.quiesce()
    path, manifest = checked_manifest(engine, path)
    sched, cfg = engine.schedule, engine.config
    same_layout = (manifest["num_ranks"] == sched.num_ranks and manifest["dp"] == cfg.layout.dp
                   and manifest["stage_to_rank"] == list(sched.stage_to_rank)
                   and manifest["config"].get("tp", 1) == cfg.layout.tp)  # files hold whole tensors: any tp loads them
    what = f"loading the checkpoint {path}"
    reports = [ShardReport._make(r) for r in engine.client.read_shards(path, same_layout, what)]
    try:
        errors = [r.error for r in reports if r.error]
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            raise CheckpointError(f"loading the checkpoint {path} failed: {errors[0]}{more}; the pipeline is "
                                  f"unchanged", path=path)
        for report in reports:  # what the files hold, against the modules
            for s, shapes in report.shapes.items():
                check_stage_state(engine.stages, int(s), shapes, path)
    except BaseException:
        engine.client.apply_shards(False, what)
        raise
    engine.client.apply_shards(True, what)
    if not same_layout:
        warn_user(f"the checkpoint {path} was written on {manifest['num_ranks']} ranks x dp={manifest['dp']} "
                  f"x tp={manifest['config'].get('tp', 1)} x ep={manifest.get('ep', 1)} "
                  f"with stage -> rank {manifest['stage_to_rank']}; this pipeline runs {sched.num_ranks} ranks x "
                  f"dp={cfg.layout.dp} x tp={cfg.layout.tp} x ep={cfg.layout.ep} with stage -> rank {list(sched.stage_to_rank)}, so the "
                  f"actors' random number generators start fresh (dropout masks will differ)")
    engine.resume_at(int(manifest["step"]))
    return manifest


def checked_manifest(engine: Engine, path: str) -> tuple[str, dict]:
    """The complete checkpoint at ``path`` and its manifest, checked against ``engine``'s
    stages (count, keys, shapes) before anything is sent to the actors."""
    path = _resolve(path)
    manifest = read_manifest(path)
    if manifest["num_stages"] != engine.schedule.num_stages:
        raise ValueError(f"the checkpoint {path} has {manifest['num_stages']} stages but this pipeline has "
                         f"{engine.schedule.num_stages}; load it with the same stage list")
    for s, shapes in enumerate(manifest["stage_shapes"]):
        check_stage_state(engine.stages, s, shapes, path)
    return path, manifest


def check_stage_state(stages, s: int, saved: dict, path: str) -> None:
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
    options = {"schedule": manifest["schedule"], **restored_options(path, manifest)}
    options.update(overrides)
    ep, dp, cp = options.get("ep", 1), options.get("dp", 1), options.get("cp", 1)
    if "ep" not in overrides and all(isinstance(v, int) for v in (ep, dp, cp)) and ep > 1 and (dp * cp) % ep:
        # the saved ep does not fit the dp x cp asked for; the files load at any ep (Note [expert pieces])
        warn_user(f"the checkpoint {path} was written at ep={ep}, which does not divide dp={dp}{f' x cp={cp}' if cp > 1 else ''}; loading it at "
                  f"ep=1 (pass ep=... to Pipeline.load to choose another)")
        options["ep"] = 1
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
