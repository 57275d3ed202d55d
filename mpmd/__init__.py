"""mpmd: MPMD pipeline-parallel training of PyTorch models on Ray actors."""

from .errors import ActorDiedError, PipelineError, PipelineTimeoutError, StageFailedError
from .pipefill import FillJob
from .pipeline import Pipeline

__all__ = ["Pipeline", "FillJob", "PipelineError", "StageFailedError", "ActorDiedError", "PipelineTimeoutError"]
