"""PipeFill on the actor: run chunks of independent fill jobs in ``FILL`` slots.

A fill job's function and its whole input data are shipped once (``register``; the
data comes through Ray's object store, so actors on one node share one copy).  Each
step the controller names which input ranges run in which of the rank's fill slots:
a ``FillChunk(job, start, n, predicted_s)`` each, a few bytes (``actors/protocol.py``).
Outputs stay on the actor until the controller takes them (``take_outputs``, every few
steps and at the end): moving them with every step would put serialization and the
object store on the main job's path.  A chunk that raises returns its traceback; it
never stops the main job's program.
"""

from __future__ import annotations

import contextlib
import traceback
from typing import Any, Callable, Optional

import numpy as np
import torch

from .protocol import ChunkResult, FillChunk, FillSlot
from .timing import DeviceTimer, stream_timer

__all__ = ["FillRunner", "unbatch", "to_wire", "from_wire"]


class FillRunner:
    def __init__(self, timer: Optional[DeviceTimer] = None) -> None:
        # Chunks run and are timed on a stream of their own, made on first use (Note [device timing]);
        # ``timer``: given instead (tests).
        self.timer, self._stream = timer, None
        self.jobs: dict[int, tuple[Callable, bool, Any]] = {}
        self.outputs: dict[tuple[int, int], Any] = {}  # (job, start) -> outputs, until taken

    def register(self, job_id: int, fn: Callable, collate: bool, data: Any) -> None:
        """``data``: every input of the job, stacked (one array, ``collate``) or a list."""
        self.jobs[job_id] = (fn, collate, data)

    def drop(self, job_ids: list[int]) -> None:
        """The jobs are finished: their inputs go (Note [finished fill jobs] in mpmd/pipefill/manager.py)."""
        for job_id in job_ids:
            self.jobs.pop(job_id, None)

    def run(self, chunk: FillChunk, device: torch.device) -> ChunkResult:
        """Run inputs ``chunk.start .. chunk.start + chunk.n`` of the job's data on an
        actor whose main job runs on ``device``.

        Outputs travel batched when the function returns tensors with one row per
        input (one object, not one per sample).  The chunk runs under a fork of the
        global RNG state (CPU and ``device``): whatever it draws or reseeds, the main
        job's random stream (dropout) is the one it would be without fill work."""
        job_id, start, n = chunk.job, chunk.start, chunk.n
        cuda = [device] if device.type == "cuda" else []
        timer = self._timer(device)
        t0 = timer.seconds()
        try:
            fn, collate, data = self.jobs[job_id]  # an unknown job fails the chunk, not the main step
            if isinstance(data, np.ndarray):
                payload = torch.from_numpy(np.array(data[start:start + n]))  # the store's copy is read-only
            else:
                payload = data[start:start + n]
            on_stream = torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext()
            with torch.random.fork_rng(devices=cuda, device_type="cuda"), on_stream:
                self.outputs[(job_id, start)] = _call(fn, payload, n, collate)
            error = None
        except Exception:  # noqa: BLE001 - a failing fill job must not stop the main job
            error = traceback.format_exc()
        return ChunkResult(job_id, start, n, seconds=timer.seconds() - t0, error=error)  # its outputs are done

    def _timer(self, device: torch.device) -> DeviceTimer:
        if self.timer is None:
            self.timer, self._stream = stream_timer(device)
        return self.timer

    def run_slot(self, slot: FillSlot, device: torch.device, arrived: Callable[[], bool]) -> list[ChunkResult]:
        """A fill slot's chunks: each starts while the slot's time budget (the bubble the
        controller measured, less its margin) has room for it, scaled by how the chunks
        already run here compare with their predicted time, and while ``arrived()`` (the
        receive the slot precedes) says False.  Chunks not started come back ``skipped``,
        to be handed out again."""
        timer = self._timer(device)
        t0 = timer.seconds()
        predicted = actual = 0.0
        results = []
        for chunk in slot.chunks:
            scale = actual / predicted if predicted else 1.0
            late = timer.seconds() - t0 + chunk.predicted_s * max(scale, 1.0) > slot.budget_s
            if late or arrived():
                results.append(self.skipped(chunk))
                continue
            result = self.run(chunk, device)
            predicted, actual = predicted + chunk.predicted_s, actual + result.seconds
            results.append(result)
        return results

    @staticmethod
    def skipped(chunk: FillChunk) -> ChunkResult:
        """A chunk not started: its slot's budget was spent, or the bubble ended early."""
        return ChunkResult(chunk.job, chunk.start, chunk.n, skipped=True)

    def take_outputs(self) -> dict[tuple[int, int], Any]:
        """Every output not yet taken, ready to travel; the runner forgets them."""
        taken, self.outputs = self.outputs, {}
        return {key: to_wire(value) for key, value in taken.items()}


def _call(fn: Callable, payload: Any, n: int, collate: bool) -> Any:
    result = fn(payload)
    if collate and _rows(result) == n:
        return result
    outputs = list(result)
    if len(outputs) != n:
        raise ValueError(f"fill function returned {len(outputs)} outputs for {n} inputs; "
                         "return one output (or one row of a batch) per input")
    return outputs


def _rows(result: Any) -> int:
    if isinstance(result, torch.Tensor):
        return result.shape[0] if result.dim() else -1
    if isinstance(result, tuple) and result and all(isinstance(r, torch.Tensor) for r in result):
        rows = {_rows(r) for r in result}
        return rows.pop() if len(rows) == 1 else -1
    return -1


# Outputs travel as numpy arrays where they can (they pickle, and come out of the object
# store, without a copy); anything else as a detached CPU copy.
def to_wire(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        if value.dtype != torch.bfloat16 and not value.is_complex():
            return ("np", value.numpy())
        return ("pt", value.clone())
    if isinstance(value, tuple):
        return ("tuple", [to_wire(v) for v in value])
    if isinstance(value, list):
        return ("list", [to_wire(v) for v in value])
    return ("obj", value)


def from_wire(value: Any) -> Any:
    tag, body = value
    if tag == "np":
        return torch.from_numpy(np.array(body))  # copy: the store's buffer is read-only
    if tag == "tuple":
        return tuple(from_wire(v) for v in body)
    if tag == "list":
        return [from_wire(v) for v in body]
    return body


def unbatch(outputs: Any, n: int) -> list:
    """Per-input outputs from a chunk's outputs (a batch, a tuple of batches, or a list)."""
    if isinstance(outputs, torch.Tensor):
        return list(outputs.unbind(0))
    if isinstance(outputs, tuple):
        parts = [list(o.unbind(0)) for o in outputs]
        return [tuple(p[i] for p in parts) for i in range(n)]
    return list(outputs)
