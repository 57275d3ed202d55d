"""Checks of what goes into the pipeline, and errors that say which stage and what it got.

The first stage's inputs are checked on the controller before dispatch against the
first step's (structure and dtypes: shapes may change, the actors relearn them); what
only an actor can find out (a module refusing an input's shape, a stage's output that
does not fit the next stage) comes back as a ``StageFailedError`` that the controller
rewrites to name the stages involved and what they got.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from typing import Any, Optional, Sequence

import torch

from actors.values import flatten
from schedules import Action, Kind

from ..errors import StageFailedError

__all__ = ["InputRecord", "record_inputs", "check_inputs", "explain_stage_failure", "finite_loss", "warn_user",
           "nonfinite_loss_error", "check_state_dict"]

InputRecord = tuple  # (structure, ((shape, dtype), ...)) of one microbatch of the first stage's inputs


def record_inputs(value: Any) -> InputRecord:
    spec, tensors = flatten(value, where="inputs")
    return spec, tuple((tuple(t.shape), t.dtype) for t in tensors)


def describe(record: InputRecord) -> str:
    """E.g. ``(4, 6) float32`` or ``((4, 6) float32, {'mask': (4,) int64})``."""
    spec, metas = record
    it = iter(metas)

    def render(s) -> str:
        if s == "T":
            shape, dtype = next(it)
            return f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
        tag, items = s
        if tag == "D":
            return "{" + ", ".join(f"{k!r}: {render(x)}" for k, x in items) + "}"
        inner = ", ".join(render(x) for x in items)
        return f"[{inner}]" if tag == "L" else f"({inner}{',' if len(items) == 1 else ''})"

    return render(spec)


def stage_name(stages: Sequence[torch.nn.Module], s: int) -> str:
    return f"stage {s} ({type(stages[s]).__name__})"


def check_inputs(stages: Sequence[torch.nn.Module], expected: Optional[InputRecord], got: InputRecord) -> None:
    """Refuse, before dispatch, inputs whose structure or dtypes differ from the first step's."""
    if expected is None or expected == got:
        return
    (spec_e, metas_e), (spec_g, metas_g) = expected, got
    same_kind = spec_e == spec_g and all(
        len(se) == len(sg) and de == dg for (se, de), (sg, dg) in zip(metas_e, metas_g))
    if same_kind:
        return  # only sizes changed: the actors relearn shapes (README, "dynamic_shapes")
    raise ValueError(
        f"{stage_name(stages, 0)} expects inputs like the first step's: {describe(expected)} per microbatch, "
        f"but got {describe(got)}; pass tensors of the first step's structure, dtypes and number of "
        f"dimensions (e.g. convert with inputs.to({metas_e[0][1] if metas_e else 'dtype'})), "
        f"or build a new Pipeline for the new kind of input"
    )


def explain_stage_failure(err: StageFailedError, stages: Sequence[torch.nn.Module],
                          got: InputRecord, first: Optional[InputRecord]) -> StageFailedError:
    """A forward that failed on its input: say which stage got what from where."""
    try:
        action = Action.parse(err.instruction)
    except Exception:  # noqa: BLE001 - not an action's text: leave the error as it is
        return err
    if action.kind is not Kind.F or not 0 <= action.stage < len(stages):
        return err
    s = action.stage
    if err.in_loss:
        lead = (f"loss_fn failed on the output of {stage_name(stages, s)}, the last stage, and the targets "
                f"({stage_name(stages, s)} itself ran): its error, and what it got, below")
    elif s == 0:
        lead = f"{stage_name(stages, 0)} failed on the step's inputs: got {describe(got)} per microbatch"
        if first is not None and first != got:
            lead += f", expected {describe(first)} as in the first step"
    else:
        lead = (f"{stage_name(stages, s)} failed on the output of {stage_name(stages, s - 1)}: the output of "
                f"stage {s - 1} does not fit stage {s}, or stage {s} has a bug (its error below)")
    return StageFailedError(f"{lead}\n{err}", rank=err.rank, stage=err.stage, step=err.step,
                            instruction=err.instruction, actor_traceback=err.actor_traceback, in_loss=err.in_loss)


def warn_user(message: str) -> None:
    """A ``UserWarning`` attributed to the first caller outside the ``mpmd`` package (the user's line)."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, UserWarning, stacklevel=level)


def finite_loss(loss: float, losses: list) -> bool:
    """Whether the step's loss and every microbatch's are finite (``Pipeline(on_nan=...)``)."""
    return math.isfinite(loss) and all(math.isfinite(x) for x in losses)


def nonfinite_loss_error(step: int, loss: float, losses: list, grad_norm: Optional[float] = None) -> FloatingPointError:
    shown = ", ".join(f"{x:.4g}" for x in losses[:8]) + (", ..." if len(losses) > 8 else "")
    what = (f"the loss is {loss} (microbatch losses: {shown})" if not finite_loss(loss, losses) else
            f"the loss is {loss} but a gradient is not finite (gradient norm {grad_norm})")
    err = FloatingPointError(
        f"step {step}: {what}; no actor applied the step (parameters, optimizer and LR scheduler state are as before "
        f"it). Lower the learning rate or check the data, or pass Pipeline(..., on_nan='skip') to drop such steps "
        f"and go on"
    )
    err.step = step
    return err


def check_state_dict(expected: dict, state_dict: dict) -> None:
    """``load_state_dict``'s argument has exactly the pipeline's keys and shapes (``expected``:
    key -> shape, or a tensor of that shape)."""
    missing, unexpected = sorted(set(expected) - set(state_dict)), sorted(set(state_dict) - set(expected))
    if missing or unexpected:
        raise ValueError(f"state_dict does not match the stages: missing keys {missing[:5]}, "
                         f"unexpected keys {unexpected[:5]}")
    for key, value in state_dict.items():
        got, want = tuple(torch.as_tensor(value).shape), tuple(getattr(expected[key], "shape", expected[key]))
        if got != want:
            raise ValueError(f"state_dict[{key!r}] has shape {got}, but the stage's tensor has shape {want}")
