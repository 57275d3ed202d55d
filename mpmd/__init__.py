"""mpmd: MPMD pipeline-parallel training of PyTorch models on Ray actors.

``Pipeline`` (``pipeline.py``) is the API; under it ``runtime/`` runs the actors, and one
folder per feature sits around it: ``training/`` (fit, checkpoints), ``planning/``
(split, auto), ``pipefill/``, ``terapipe/``, ``profiler/``; ``models/`` holds demo models
and ``cli/`` the ``python -m mpmd`` commands.
"""

from .errors import ActorDiedError, PipelineError, PipelineTimeoutError, StageFailedError
from .pipefill import FillJob
from .pipeline import Pipeline, build_stages, reuse_actors, stage_seed
from .planning import PipelineYield, split

__all__ = ["Pipeline", "PipelineYield", "split", "build_stages", "stage_seed", "reuse_actors", "FillJob",
           "PipelineError", "StageFailedError", "ActorDiedError", "PipelineTimeoutError"]
