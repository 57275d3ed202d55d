"""Errors raised inside actors, carrying where they happened."""

from __future__ import annotations

import os
import traceback
from typing import Any, Sequence

from .values import describe

__all__ = ["StageError", "LossFnError", "instruction_error", "cuda_hint"]


class LossFnError(Exception):
    """``loss_fn`` raised, or returned something other than a scalar tensor: the last stage
    ran fine; the message names the loss function, the stage's output and the targets."""


class StageError(RuntimeError):
    """An instruction failed inside an actor.

    ``rank``, ``stage``, ``step`` and ``instruction`` say where; ``actor_traceback``
    is the formatted traceback from inside the actor; ``in_loss``: it was ``loss_fn``
    that failed, after the stage's forward ran (``LossFnError``).
    """

    def __init__(self, message: str, *, rank: int, stage: int, step: int, instruction: str, actor_traceback: str,
                 in_loss: bool = False):
        super().__init__(message)
        self.rank, self.stage, self.step, self.instruction = rank, stage, step, instruction
        self.actor_traceback, self.in_loss = actor_traceback, in_loss

    def __reduce__(self):
        return (_rebuild, (self.args[0], self.rank, self.stage, self.step, self.instruction, self.actor_traceback,
                           self.in_loss))


def _rebuild(message, rank, stage, step, instruction, tb, in_loss=False):
    return StageError(message, rank=rank, stage=stage, step=step, instruction=instruction, actor_traceback=tb,
                      in_loss=in_loss)


def instruction_error(exc: BaseException, *, rank: int, replica: int, step: int, program_name: str,
                      program: Sequence, index: int, stage_input: Any = None, nccl: bool = False,
                      part: Any = None) -> StageError:
    """The error of instruction ``index`` of a program: where it was, the program around it
    and, for a forward, the input it got; ``part``: of an ``OVERLAP``, the part that failed
    (its stage is the error's)."""
    whole = program[index]
    ins = part if part is not None else whole
    lo = max(0, index - 3)
    context = " ".join((">" + repr(x) + "<") if j == index else repr(x) for j, x in enumerate(program[lo:index + 4],
                                                                                                start=lo))
    which = f"{whole!r}" if part is None else f"{whole!r} (its part {part!r})"
    msg = (f"rank {rank} (replica {replica}), stage {ins.stage}, step {step}, instruction {index} {which} of the "
           f"{program_name} program failed: {type(exc).__name__}: {exc}\n  program around it: {context}")
    hint = cuda_hint(exc, nccl)
    if hint:
        msg += f"\n  {hint}"
    in_loss = isinstance(exc, LossFnError)
    if stage_input is not None and not in_loss:
        source = "the step's inputs" if ins.stage == 0 else f"the output of stage {ins.stage - 1}"
        msg += f"\n  its input ({source}): {describe(stage_input)}"
    return StageError(msg, rank=rank, stage=ins.stage, step=step, instruction=repr(ins),
                      actor_traceback="".join(traceback.format_exception(exc)), in_loss=in_loss)


_CUDA_SIGNS = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert", "illegal memory access",
               "an illegal instruction", "NCCL error", "unspecified launch failure")


def cuda_hint(exc: BaseException, nccl: bool = False) -> str:
    """What to do about an asynchronous CUDA error: kernels run after their launch returns, so
    the error surfaces at the next synchronisation, often in a later instruction than its cause.
    Not where actors talk over NCCL (``nccl``): with every launch synchronous, a send waits in
    its launch for the peer's receive, which the peer posts later in its program: a hang."""
    if not any(sign in str(exc) for sign in _CUDA_SIGNS) or os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
        return ""
    if nccl:
        return ("a CUDA error surfaces at the next synchronisation, often after the instruction that caused it; "
                "to find it, run the same stages with transport='gloo' and CUDA_LAUNCH_BLOCKING=1 in the actors' "
                "environment (over NCCL that setting would hang the pipeline)")
    return ("a CUDA error surfaces at the next synchronisation, often after the instruction that caused it: rerun "
            "with CUDA_LAUNCH_BLOCKING=1 in the actors' environment (e.g. ray.init(runtime_env={'env_vars': "
            "{'CUDA_LAUNCH_BLOCKING': '1'}})) to see the instruction that failed")
