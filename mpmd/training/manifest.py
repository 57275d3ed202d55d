"""A checkpoint's ``manifest.json``: reading it, and which of the pipeline's options it keeps
(Note [what a manifest restores]).  The rest of the format: ``checkpoint.py``."""

from __future__ import annotations

import json
import logging
import os

from schedules import Schedule

from ..runtime import FLAT_OPTIONS, PipelineConfig
from .async_save import CheckpointError

__all__ = ["FORMAT", "MANIFEST", "RESTORED_OPTIONS", "UnreadableCheckpointError", "read_manifest", "saved_options",
           "restored_options"]

FORMAT = "mpmd-checkpoint/1"
MANIFEST = "manifest.json"
log = logging.getLogger(__name__)


class UnreadableCheckpointError(CheckpointError, ValueError):
    """A checkpoint's manifest cannot be read or is not one this version writes; a resume
    falls back to an older checkpoint (``FitCheckpoints.resume``)."""


# What a manifest must hold, with the type of each (read_manifest).
_MANIFEST_FIELDS = {"step": int, "num_stages": int, "schedule": str, "num_ranks": int, "dp": int,
                    "stage_to_rank": list, "config": dict, "stage_shapes": list}


def read_manifest(path: str) -> dict:
    """The checkpoint's manifest, or ``UnreadableCheckpointError`` saying what is wrong with it."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UnreadableCheckpointError(f"the manifest of {path} cannot be read: {e}", path=path) from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UnreadableCheckpointError(f"{path} is not an mpmd checkpoint of format {FORMAT!r} (got {got!r})",
                                        path=path)
    wrong = [k for k, t in _MANIFEST_FIELDS.items() if not isinstance(manifest.get(k), t)
             or isinstance(manifest.get(k), bool)]
    if wrong:
        raise UnreadableCheckpointError(f"the manifest of {path} is malformed: {', '.join(wrong)} missing or of the "
                                        f"wrong type", path=path)
    return manifest


# Note [what a manifest restores]
# A checkpoint may come from anywhere (downloaded, shared, copied from another cluster), so
# ``Pipeline.load`` takes from its manifest how to train (the schedule and its options, the
# layout of stages over ranks and replicas, the recipe) and never where or on what to run.
# ``address`` above all: a manifest naming a Ray cluster would make ``Pipeline.load`` ship the
# user's stages and weights to it and unpickle its replies (code execution, whatever
# ``weights_only=True`` guarantees for the files).  Devices, CPUs, GPUs, placement, spares,
# transport and timeouts belong to the machine that loads it too.  Only the options listed
# here are written, only they are read back (with their batching strategy's, which is held to
# its own list), and an older manifest's others are ignored with a log line.  Every value read
# is validated again by ``PipelineConfig``.  The keys are ``Pipeline``'s flat keywords (Note
# [flat options] in mpmd/runtime/config.py), written and read as every manifest so far has them;
# ``num_microbatches`` is the schedule's.
RESTORED_OPTIONS = ("num_microbatches", "num_actors", "dp", "zero", "tp", "tp_plan", "loss_parallel", "fusion",
                    "bucket_bytes", "overlap_reduce", "dynamic_shapes", "seed", "on_nan", "clip_grad_norm",
                    "clip_norm_type", "precision", "recompute", "ep", "moe_aux_loss_coef", "moe_bias_update_rate",
                    "cp", "document_mask")
_BATCHING_OPTIONS = ("schedule", "num_microbatches", "token_slices")  # Batching.checkpoint_options()


def saved_options(cfg: PipelineConfig, schedule: Schedule) -> dict:
    """The options a manifest keeps (Note [what a manifest restores]) of a pipeline running
    ``schedule``; plain values only (a ``tp_plan`` other than "auto" is code, given again to
    ``Pipeline.load``)."""
    out = {}
    for name in RESTORED_OPTIONS:
        v = schedule.num_microbatches if name == "num_microbatches" else cfg.option(name)
        if isinstance(v, tuple):
            v = list(v)
        if v is None or isinstance(v, (bool, int, float, str)) or (isinstance(v, list) and all(
                isinstance(x, int) for x in v)):
            out[name] = v
    return out


def restored_options(path: str, manifest: dict) -> dict:
    """The Pipeline options a manifest may set (Note [what a manifest restores]); the rest of
    what it holds is logged and dropped."""
    config, batching = manifest.get("config") or {}, manifest.get("batching") or {}
    if not isinstance(config, dict) or not isinstance(batching, dict):
        raise CheckpointError(f"the manifest of {path} is malformed: 'config' and 'batching' must be objects",
                              path=path)
    options = {k: v for k, v in config.items() if k in RESTORED_OPTIONS}
    options.update({k: v for k, v in batching.items() if k in _BATCHING_OPTIONS})
    defaults = {k: PipelineConfig().option(k) for k in FLAT_OPTIONS} | {"num_microbatches": 4}
    ignored = {k: v for k, v in [*config.items(), *batching.items()]  # an old manifest's defaults go unsaid
               if k not in RESTORED_OPTIONS and k not in _BATCHING_OPTIONS and not (k in defaults and defaults[k] == v)}
    if ignored:
        log.warning("the checkpoint %s also names %s; a checkpoint sets how to train, not where or on what to run, "
                    "so these are ignored (pass them to Pipeline.load to set them)", path,
                    ", ".join(f"{k}={v!r}" for k, v in sorted(ignored.items())))
    return options
