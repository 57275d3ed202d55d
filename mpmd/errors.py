"""Errors the controller raises."""

from __future__ import annotations

__all__ = ["PipelineError", "StageFailedError", "ActorDiedError", "PipelineTimeoutError"]


class PipelineError(RuntimeError):
    """Base class of the runtime's errors."""


class StageFailedError(PipelineError):
    """An instruction raised inside an actor.  ``rank``, ``stage``, ``step`` and
    ``instruction`` say where; ``actor_traceback`` is the actor's traceback; ``in_loss``:
    ``loss_fn`` failed on the last stage's output (the stage itself ran)."""

    def __init__(self, message: str, *, rank: int, stage: int, step: int, instruction: str, actor_traceback: str,
                 in_loss: bool = False):
        super().__init__(message)
        self.rank, self.stage, self.step, self.instruction = rank, stage, step, instruction
        self.actor_traceback, self.in_loss = actor_traceback, in_loss


class ActorDiedError(PipelineError):
    """An actor process died (killed, out of memory, node lost)."""

    def __init__(self, message: str, *, rank: int, stages: tuple, step: int):
        super().__init__(message)
        self.rank, self.stages, self.step = rank, stages, step


class PipelineTimeoutError(PipelineError):
    """A step did not finish within ``step_timeout_s``."""
