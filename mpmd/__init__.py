"""mpmd: MPMD pipeline-parallel training of PyTorch models on Ray actors."""

from .errors import ActorDiedError, PipelineError, PipelineTimeoutError, StageFailedError
from .pipeline import Pipeline

__all__ = ["Pipeline", "PipelineError", "StageFailedError", "ActorDiedError", "PipelineTimeoutError"]
