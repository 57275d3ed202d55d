"""Training on a running pipeline: ``fit``'s loop with periodic checkpoints, resume and
restarts, the checkpoint format, the per-step metrics (callbacks, loggers) and the progress
bar.  (The training recipe, gradient clipping, LR schedules and precision, will live here too.)

    fit.py              Pipeline.fit: one step in flight, checkpoints, resume, restarts; FitHistory
    fit_checkpoints.py  fit's checkpoints: the last complete one, what to replay, pruning
    checkpoint.py       checkpoint directories: save and load, sharded over the actors; the newest of a run
    manifest.py         a checkpoint's manifest: reading it, the options it keeps (never where to run)
    async_save.py       saves in flight (save(blocking=False)): PendingSave, CheckpointError
    atomic.py           temporary directory, fsync, rename: a checkpoint appears whole or not at all
    callbacks.py        each step's record to fit's callbacks: CSVLogger, TensorBoardLogger
    progress.py         the progress display: a tqdm bar on a terminal, plain lines in a log
"""

from .async_save import CheckpointError, PendingSave
from .callbacks import STEP_FIELDS, Callback, CSVLogger, TensorBoardLogger
from .checkpoint import is_checkpoint, latest_checkpoint, read_manifest
from .fit import FitHistory, FitOptions

__all__ = ["latest_checkpoint", "is_checkpoint", "read_manifest", "CheckpointError", "PendingSave", "FitOptions",
           "FitHistory", "Callback", "CSVLogger", "TensorBoardLogger", "STEP_FIELDS"]
