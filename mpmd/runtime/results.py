"""What a step gives back: ``StepResult``, and ``PendingStep`` for a step whose calls are out."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from actors.protocol import ChunkResult, StepReply

__all__ = ["StepResult", "PendingStep"]


@dataclasses.dataclass(frozen=True)
class StepResult:
    """What one step gave back: the mean loss, every microbatch's loss, each actor's reply."""

    program: str
    step: int  # the step's index (training steps are counted from 0)
    loss: Optional[float]  # mean over every microbatch of every replica; None without a loss
    losses: tuple[float, ...]  # per microbatch, replica-major
    replies: tuple[StepReply, ...]  # per actor, in actor order
    outputs: Any = None  # collect=True: the last stage's outputs joined into one batch

    @property
    def grad_norm(self) -> Optional[float]:
        """The global gradient norm before clipping (``Pipeline(clip_grad_norm=...)``), else None."""
        return next((r.grad_norm for r in self.replies if r.grad_norm is not None), None)

    @property
    def lr(self) -> Optional[float]:
        """The learning rate the step was taken with (the first stage's first parameter group)."""
        return next((r.lr for r in self.replies if r.lr is not None), None)

    @property
    def moe_metrics(self) -> dict:
        """The MoE blocks' metrics after the step (per-expert token loads summed over the replicas,
        auxiliary losses, router biases: actors/experts.py ``finish_step``), ``{name: value}``, each
        name prefixed with its stage; empty without watched MoE blocks (docs/moe.md)."""
        out: dict = {}
        for r in self.replies:
            out.update(r.moe or {})
        return out

    @property
    def skipped(self) -> bool:
        """The actors agreed not to apply this step (a non-finite loss or gradient)."""
        return any(r.skipped for r in self.replies)

    @property
    def timelines(self) -> list[list]:
        """Per actor, the profiled step's ``(position, start_ns, end_ns)`` entries."""
        return [r.timeline for r in self.replies]

    @property
    def fill_results(self) -> list[ChunkResult]:
        return [c for r in self.replies for c in r.fills]


class PendingStep:
    """A training step whose calls are out (``Pipeline.step_async``); ``complete`` waits for
    it, running ``while_waiting()`` on the controller first."""

    def __init__(self, step: int, complete: Callable[[Optional[Callable[[], None]]], StepResult]) -> None:
        self.step = step
        self._complete: Optional[Callable] = complete
        self._done: Optional[StepResult] = None

    @classmethod
    def finished(cls, result: StepResult) -> "PendingStep":
        """A step that already ran (synchronously, e.g. with fill jobs)."""
        pending = cls(result.step, lambda _: result)
        pending.wait()
        return pending

    def wait(self, while_waiting: Optional[Callable[[], None]] = None) -> StepResult:
        """Wait for the step (raises what a synchronous step would); its ``StepResult``."""
        if self._done is None:
            self._done = self._complete(while_waiting)
            self._complete = None
        return self._done

    def result(self) -> float:
        """Wait for the step; its mean loss."""
        return self.wait().loss
