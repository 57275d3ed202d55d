"""PipeFill on the actor: run chunks of independent fill jobs in ``FILL`` slots.

A fill job's function is shipped once (``register``); each step the controller
assigns chunks of its inputs to the rank's fill slots.  A chunk that raises marks
its result with the traceback; it never stops the main job's program.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import numpy as np
import torch

__all__ = ["FillRunner", "unbatch"]


class FillRunner:
    def __init__(self) -> None:
        self.fns: dict[int, tuple[Callable, bool]] = {}

    def register(self, job_id: int, fn: Callable, collate: bool) -> None:
        self.fns[job_id] = (fn, collate)

    def run(self, chunk: tuple) -> dict:
        """Run ``(job_id, start, n, payload)``: a stacked batch (collate) or a list of inputs.

        Outputs travel back batched when the function returns tensors with one row per
        input (one message, not one per sample)."""
        job_id, start, n, payload = chunk
        fn, collate = self.fns[job_id]
        if collate and isinstance(payload, np.ndarray):
            payload = torch.from_numpy(payload if payload.flags.writeable else payload.copy())
        t0 = time.perf_counter()
        try:
            outputs = _call(fn, payload, n, collate)
            error = None
        except Exception:  # noqa: BLE001 - a failing fill job must not stop the main job
            outputs, error = None, traceback.format_exc()
        return {"job": job_id, "start": start, "n": n, "outputs": outputs, "error": error,
                "seconds": time.perf_counter() - t0}


def _call(fn: Callable, payload: Any, n: int, collate: bool) -> Any:
    result = fn(payload)
    if collate and _rows(result) == n:
        return _detach(result)
    outputs = list(result)
    if len(outputs) != n:
        raise ValueError(f"fill function returned {len(outputs)} outputs for {n} inputs; "
                         "return one output (or one row of a batch) per input")
    return [_detach(o) for o in outputs]


def _rows(result: Any) -> int:
    if isinstance(result, torch.Tensor):
        return result.shape[0] if result.dim() else -1
    if isinstance(result, tuple) and result and all(isinstance(r, torch.Tensor) for r in result):
        rows = {_rows(r) for r in result}
        return rows.pop() if len(rows) == 1 else -1
    return -1


def unbatch(outputs: Any, n: int) -> list:
    """Per-input outputs from what ``run`` returned (a batch or a list)."""
    if isinstance(outputs, torch.Tensor):
        return list(outputs.unbind(0))
    if isinstance(outputs, tuple):
        parts = [list(o.unbind(0)) for o in outputs]
        return [tuple(p[i] for p in parts) for i in range(n)]
    return list(outputs)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value
