"""Training on a running pipeline: ``fit``'s loop with periodic checkpoints, resume and
restarts, the checkpoint format, and the progress bar.  (The training recipe, gradient
clipping, LR schedules and precision, will live here too.)

    fit.py         Pipeline.fit: one step in flight, checkpoints, resume, restarts
    checkpoint.py  atomic checkpoint directories: save, load, the newest of a run
    progress.py    the one-line progress bar
"""

from .checkpoint import is_checkpoint, latest_checkpoint, read_manifest
from .fit import FitOptions

__all__ = ["latest_checkpoint", "is_checkpoint", "read_manifest", "FitOptions"]
