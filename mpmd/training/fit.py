"""``Pipeline.fit``'s loop: periodic checkpoints, resume from the newest one, and restarts
with fresh actors after a failure (see ``checkpoint.py`` for the checkpoint format)."""

from __future__ import annotations

import collections
import dataclasses
import os
import shutil
from typing import Any, Callable, Iterable, Iterator, Optional

from ..errors import ActorDiedError, PipelineTimeoutError
from ..runtime import Engine, PendingStep
from ..runtime.checks import warn_user
from .checkpoint import checkpoint_name, latest_checkpoint, load_checkpoint, read_manifest, save_checkpoint
from .progress import Progress

__all__ = ["FitOptions", "fit_loop", "unpack_batch"]

_END = object()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FitOptions:
    epochs: int = 1
    progress: bool = True
    checkpoint_dir: Optional[str] = None
    checkpoint_every: Optional[int] = None
    resume: bool = True
    max_restarts: int = 0
    keep_checkpoints: Optional[int] = 3

    def __post_init__(self) -> None:
        if not isinstance(self.epochs, int) or self.epochs < 1:
            raise ValueError(f"epochs must be >= 1, got {self.epochs}")
        if self.checkpoint_every is not None and (not isinstance(self.checkpoint_every, int)
                                                  or self.checkpoint_every < 1):
            raise ValueError(f"checkpoint_every must be a positive number of steps, got {self.checkpoint_every!r}")
        if self.checkpoint_every is not None and self.checkpoint_dir is None:
            raise ValueError("checkpoint_every needs checkpoint_dir: fit(..., checkpoint_dir='ckpt', "
                             f"checkpoint_every={self.checkpoint_every})")
        if not isinstance(self.max_restarts, int) or self.max_restarts < 0:
            raise ValueError(f"max_restarts must be an integer >= 0, got {self.max_restarts!r}")
        if self.max_restarts and self.checkpoint_dir is None:
            raise ValueError("max_restarts needs checkpoint_dir (restarts resume from the last checkpoint): "
                             "fit(..., checkpoint_dir='ckpt', checkpoint_every=100, max_restarts=...)")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or None (keep all), got {self.keep_checkpoints}")


def unpack_batch(batch) -> tuple[Any, Any, dict]:
    """``(inputs, targets, side)`` of one batch: a pair, a triple whose last item is a dict of
    side inputs, or a dict with the keys "inputs", "targets" and optionally "side"."""
    if isinstance(batch, dict) and {"inputs", "targets"} <= set(batch):
        return batch["inputs"], batch["targets"], dict(batch.get("side") or {})
    if isinstance(batch, (tuple, list)) and len(batch) == 3 and isinstance(batch[2], dict):
        return batch[0], batch[1], batch[2]
    try:
        inputs, targets = batch
    except (TypeError, ValueError):
        raise ValueError("each batch from data must be a pair (inputs, targets) or a triple (inputs, targets, "
                         "side inputs as a dict)") from None
    return inputs, targets, {}


def fit_loop(engine: Engine, step_async: Callable[..., PendingStep], data: Iterable,
             opts: FitOptions) -> list[float]:
    """``Pipeline.fit``: train ``engine`` on ``data``, issuing each step with ``step_async``
    (the Pipeline's, which runs fill jobs when there are some).  See the module docstring."""
    history: list[float] = []
    last: Optional[str] = None  # the checkpoint a restart goes back to
    written: list[str] = []  # checkpoints this call wrote, oldest first (keep_checkpoints prunes them)
    if opts.checkpoint_dir is not None and opts.resume:
        found = latest_checkpoint(opts.checkpoint_dir)
        if found is not None:
            history = _fit_history(load_checkpoint(engine, found))
            last = found
    if opts.max_restarts and last is None:
        last = _save_for_fit(engine, opts, history, written)
    total = len(data) * opts.epochs if hasattr(data, "__len__") else None
    bar = Progress(total, enabled=opts.progress)
    bar.count = len(history)
    source = _batches(data, opts.epochs, skip=len(history))
    replay: collections.deque = collections.deque()
    since_last: list = []  # batches consumed since `last` (replayed after a restart)
    restarts = 0
    # Note [one step in flight]: the next step is issued before waiting for the current
    # one, so each actor finds it queued the moment it finishes (no dispatch or result
    # latency between steps).  A checkpoint is taken with nothing in flight.
    pending = None

    def complete() -> None:
        nonlocal pending, last, since_last
        done, pending = pending, None
        history.append(done.result())
        bar.update(loss=history[-1])
        if _checkpoint_due(opts, done.step):
            last = _save_for_fit(engine, opts, history, written)
            since_last = []

    try:
        while True:
            batch = replay.popleft() if replay else next(source, _END)
            queued = False  # batch is in since_last
            try:
                if pending is not None and (batch is _END or _checkpoint_due(opts, pending.step)):
                    complete()
                if batch is _END:
                    break
                if opts.max_restarts:
                    since_last.append(batch)
                    queued = True
                inputs, targets, side = unpack_batch(batch)
                issued = step_async(inputs, targets, **side)
                if pending is not None:
                    complete()
                pending = issued
            except (ActorDiedError, PipelineTimeoutError) as e:
                pending = None
                if restarts >= opts.max_restarts:
                    raise
                if not queued and batch is not _END:
                    replay.appendleft(batch)  # it failed before this batch was issued
                restarts += 1
                warn_user(f"restarting the pipeline's actors ({restarts} of max_restarts={opts.max_restarts}) "
                          f"from {last} after: {e}")
                engine.restart()
                history = _fit_history(load_checkpoint(engine, last))
                replay = collections.deque(since_last + list(replay))
                since_last = []
                bar.count = len(history)
        if opts.checkpoint_dir is not None and (last is None or read_manifest(last)["step"] != engine.step_count):
            _save_for_fit(engine, opts, history, written)
    finally:
        bar.close()
    return history


def _checkpoint_due(opts: FitOptions, step: int) -> bool:
    return bool(opts.checkpoint_every) and (step + 1) % opts.checkpoint_every == 0


def _fit_history(manifest: dict) -> list[float]:
    return [float(x) for x in (manifest.get("fit") or {}).get("history", [])]


def _save_for_fit(engine: Engine, opts: FitOptions, history: list[float], written: list[str]) -> str:
    path = save_checkpoint(engine, os.path.join(opts.checkpoint_dir, checkpoint_name(engine.step_count)),
                           fit_state={"history": list(history)})
    if path in written:
        written.remove(path)
    written.append(path)
    while opts.keep_checkpoints is not None and len(written) > opts.keep_checkpoints:
        shutil.rmtree(written.pop(0), ignore_errors=True)
    return path


def _batches(data: Iterable, epochs: int, skip: int) -> Iterator:
    """The batches of ``epochs`` passes over ``data``, the first ``skip`` dropped (resume)."""
    n = 0
    for epoch in range(epochs):
        seen = 0
        for batch in data:
            seen += 1
            n += 1
            if n > skip:
                yield batch
        if seen == 0:
            if epoch == 0:
                raise ValueError("fit got no batches: data is empty (pass an iterable of (inputs, targets))")
            raise ValueError(f"fit got no batches in epoch {epoch + 1}: data gave batches once and is now "
                             f"exhausted (a generator or iterator); pass a list or a re-iterable such as a DataLoader")
