"""Training on a running pipeline: ``fit``'s loop with periodic checkpoints, resume and
restarts, the checkpoint format, the per-step metrics (callbacks, loggers) and the progress
bar.  (The training recipe, gradient clipping, LR schedules and precision, will live here too.)

    fit.py         Pipeline.fit: one step in flight, checkpoints, resume, restarts; FitHistory
    checkpoint.py  atomic checkpoint directories: save, load, the newest of a run
    callbacks.py   each step's record to fit's callbacks: CSVLogger, TensorBoardLogger
    progress.py    the progress display: a tqdm bar on a terminal, plain lines in a log
"""

from .callbacks import STEP_FIELDS, Callback, CSVLogger, TensorBoardLogger
from .checkpoint import is_checkpoint, latest_checkpoint, read_manifest
from .fit import FitHistory, FitOptions

__all__ = ["latest_checkpoint", "is_checkpoint", "read_manifest", "FitOptions", "FitHistory", "Callback",
           "CSVLogger", "TensorBoardLogger", "STEP_FIELDS"]
