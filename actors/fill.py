"""PipeFill on the actor: run chunks of independent fill jobs in ``FILL`` slots.

A fill job's function is shipped once (``register``); each step the controller
assigns chunks of its inputs to the rank's fill slots.  A chunk that raises marks
its result with the traceback; it never stops the main job's program.
"""

from __future__ import annotations

import time
import traceback
from typing import Any, Callable

import torch

__all__ = ["FillRunner"]


class FillRunner:
    def __init__(self) -> None:
        self.fns: dict[int, tuple[Callable, bool]] = {}

    def register(self, job_id: int, fn: Callable, collate: bool) -> None:
        self.fns[job_id] = (fn, collate)

    def run(self, chunk: tuple[int, int, list]) -> dict:
        """Run ``(job_id, start, samples)``; returns outputs (one per sample) or the error."""
        job_id, start, samples = chunk
        fn, collate = self.fns[job_id]
        t0 = time.perf_counter()
        try:
            outputs = _call(fn, samples, collate)
            error = None
        except Exception:  # noqa: BLE001 - a failing fill job must not stop the main job
            outputs, error = None, traceback.format_exc()
        return {"job": job_id, "start": start, "n": len(samples), "outputs": outputs, "error": error,
                "seconds": time.perf_counter() - t0}


def _call(fn: Callable, samples: list, collate: bool) -> list:
    if not collate:
        outputs = list(fn(samples))
    else:
        batch = torch.stack(samples) if all(isinstance(s, torch.Tensor) for s in samples) else samples
        result = fn(batch)
        outputs = _unbatch(result, len(samples))
    if len(outputs) != len(samples):
        raise ValueError(f"fill function returned {len(outputs)} outputs for {len(samples)} inputs")
    return [_detach(o) for o in outputs]


def _unbatch(result: Any, n: int) -> list:
    if isinstance(result, torch.Tensor):
        if result.dim() and result.shape[0] == n:
            return list(result.unbind(0))
        if n == 1:
            return [result]
        raise ValueError(f"fill function returned shape {tuple(result.shape)} for a batch of {n}; "
                         "return one row per input (or pass collate=False and return a list)")
    if isinstance(result, tuple):
        parts = [_unbatch(r, n) for r in result]
        return [tuple(p[i] for p in parts) for i in range(n)]
    return list(result)


def _detach(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, tuple):
        return tuple(_detach(v) for v in value)
    return value
