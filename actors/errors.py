"""Errors raised inside actors, carrying where they happened."""

from __future__ import annotations

__all__ = ["StageError"]


class StageError(RuntimeError):
    """An instruction failed inside an actor.

    ``rank``, ``stage``, ``step`` and ``instruction`` say where; ``actor_traceback``
    is the formatted traceback from inside the actor.
    """

    def __init__(self, message: str, *, rank: int, stage: int, step: int, instruction: str, actor_traceback: str):
        super().__init__(message)
        self.rank, self.stage, self.step, self.instruction = rank, stage, step, instruction
        self.actor_traceback = actor_traceback

    def __reduce__(self):
        return (_rebuild, (self.args[0], self.rank, self.stage, self.step, self.instruction, self.actor_traceback))


def _rebuild(message, rank, stage, step, instruction, tb):
    return StageError(message, rank=rank, stage=stage, step=step, instruction=instruction, actor_traceback=tb)
