"""mpmd: MPMD pipeline-parallel training of PyTorch models on Ray actors."""

from .errors import ActorDiedError, PipelineError, PipelineTimeoutError, StageFailedError
from .pipefill import FillJob
from .pipeline import Pipeline
from .split import PipelineYield, split

__all__ = ["Pipeline", "PipelineYield", "split", "FillJob", "PipelineError", "StageFailedError",
           "ActorDiedError", "PipelineTimeoutError"]
