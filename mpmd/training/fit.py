"""``Pipeline.fit``'s loop: periodic checkpoints, resume from the newest one, restarts with
fresh actors after a failure (see ``checkpoint.py`` for the checkpoint format), each step's
record to the callbacks and the progress display (``callbacks.py``, ``progress.py``), and
``FitHistory``, what fit returns."""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Iterable, Iterator, Optional

from ..errors import ActorDiedError, PipelineTimeoutError
from ..runtime import Engine, PendingStep, StepResult
from ..runtime.batches import batch_size
from ..runtime.checks import warn_user
from .callbacks import STEP_FIELDS, CallbackList
from .fit_checkpoints import FitCheckpoints
from .progress import Progress
from .ray_data import FedData

__all__ = ["FitOptions", "FitHistory", "fit_loop", "unpack_batch", "HISTORY_KEPT"]

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
    callbacks: Any = ()  # normalized to a tuple (Note [fit callbacks] in callbacks.py)
    log_every: int = 10
    tokens_per_sample: Optional[int] = None
    checkpoint_async: bool = False  # Note [fit's last checkpoint] in fit_checkpoints.py

    def __post_init__(self) -> None:
        object.__setattr__(self, "callbacks", CallbackList(self.callbacks).callbacks)
        if not _positive_int(self.log_every):
            raise ValueError(f"log_every must be a positive number of steps, got {self.log_every!r}")
        if self.tokens_per_sample is not None and not _positive_int(self.tokens_per_sample):
            raise ValueError(f"tokens_per_sample must be a positive integer (the sequence length) or None, got "
                             f"{self.tokens_per_sample!r}")
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
        if self.max_restarts and (self.checkpoint_dir is None or self.checkpoint_every is None):
            # A restart replays the batches consumed since the last checkpoint, held until then.
            raise ValueError("max_restarts needs checkpoint_dir and checkpoint_every (restarts resume from the last "
                             "checkpoint and replay the batches since, which fit holds in memory until the next one): "
                             "fit(..., checkpoint_dir='ckpt', checkpoint_every=100, max_restarts=...)")
        if not isinstance(self.checkpoint_async, bool):
            raise ValueError(f"checkpoint_async must be True or False, got {self.checkpoint_async!r}")
        if self.checkpoint_async and self.checkpoint_dir is None:
            raise ValueError("checkpoint_async needs checkpoint_dir: fit(..., checkpoint_dir='ckpt', checkpoint_every=100, "
                             "checkpoint_async=True)")
        if self.keep_checkpoints is not None and self.keep_checkpoints < 1:
            raise ValueError(f"keep_checkpoints must be >= 1 or None (keep all), got {self.keep_checkpoints}")


def _positive_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


class FitHistory(list):
    """What ``fit`` returns: the per-step losses (a ``list``, so ``history == [0.9, 0.7]``
    holds), with ``records``, each step's record (Note [fit callbacks] in ``callbacks.py``).

    Steps before a resume or restart come back from the checkpoint with their ``step``,
    ``loss``, ``grad_norm``, ``lr`` and ``skipped``; their timings are None.  ``a + b`` and
    ``a += b`` of two histories join the records too; other list operations give losses."""

    def __init__(self, losses: Iterable[float] = (), records: Optional[Iterable[dict]] = None) -> None:
        super().__init__(losses)
        self.records: list[dict] = list(records) if records is not None else [_record_of(x) for x in self]
        if len(self.records) != len(self):
            raise ValueError(f"FitHistory got {len(self)} losses but {len(self.records)} records")

    def add(self, record: dict) -> None:
        """Append one step: its loss to the list, the record to ``records``."""
        self.append(record["loss"])
        self.records.append(record)

    @property
    def steps(self) -> list[Optional[int]]:
        return [r.get("step") for r in self.records]

    @property
    def grad_norms(self) -> list[Optional[float]]:
        """Per step, the gradient norm before clipping (None unless ``clip_grad_norm`` is on)."""
        return [r.get("grad_norm") for r in self.records]

    @property
    def lrs(self) -> list[Optional[float]]:
        """Per step, the learning rate it was taken with (None where unknown)."""
        return [r.get("lr") for r in self.records]

    def __add__(self, other: Any) -> Any:
        if isinstance(other, FitHistory):
            return FitHistory([*self, *other], self.records + other.records)
        return list(self) + other

    def __iadd__(self, other: Any) -> "FitHistory":
        other = other if isinstance(other, list) else list(other)
        if isinstance(other, FitHistory):
            self.records.extend(other.records)
        elif len(self.records) == len(self):
            self.records.extend(_record_of(x) for x in other)
        return super().__iadd__(other)


def _record_of(loss: float, **known: Any) -> dict:
    record = dict.fromkeys(STEP_FIELDS)
    record.update({"loss": loss, "skipped": False, **known})
    return record


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
             opts: FitOptions) -> FitHistory:
    """``Pipeline.fit``: train ``engine`` on ``data``, issuing each step with ``step_async``
    (the Pipeline's, which runs fill jobs when there are some).  See the module docstring."""
    history = FitHistory()
    earlier = 0  # steps consumed before history's first (Note [fit's kept history])
    ckpt = FitCheckpoints(engine, directory=opts.checkpoint_dir, every=opts.checkpoint_every,
                          keep=opts.keep_checkpoints, asynchronous=opts.checkpoint_async,
                          state=lambda: _fit_state(history, earlier))
    if opts.checkpoint_dir is not None and opts.resume:
        found = ckpt.resume()
        if found is not None:
            history, earlier = _fit_history(found)
    if opts.max_restarts and ckpt.last is None:
        ckpt.save(blocking=True)
    total = len(data) * opts.epochs if hasattr(data, "__len__") else None
    callbacks = CallbackList(opts.callbacks)
    bar = Progress(total, enabled=opts.progress, log_every=opts.log_every, start=earlier + len(history))
    fed = data if isinstance(data, FedData) else None  # a ray.data.Dataset: the actors pull the rows
    if fed is not None:
        fed.start(skip=earlier + len(history))
    source = _batches(data, opts.epochs, skip=earlier + len(history))
    replay: collections.deque = collections.deque()
    restarts = 0
    # Note [one step in flight]: the next step is issued before waiting for the current
    # one, so each actor finds it queued the moment it finishes (no dispatch or result
    # latency between steps).  A checkpoint is taken with nothing in flight.
    pending, pending_samples = None, None
    clock = time.perf_counter()  # the previous completion (a step's time runs from it)
    unlogged: Optional[dict] = None  # the newest record on_log has not had (logged at the end)

    def complete() -> None:
        nonlocal pending, clock, unlogged
        done, pending = pending, None
        result = done.wait()
        now = time.perf_counter()
        record = _step_record(result, pending_samples, now - clock, opts.tokens_per_sample)
        history.add(record)
        clock = now
        ckpt.settle(wait=False)  # Note [fit's last checkpoint] in fit_checkpoints.py
        if ckpt.due(done.step):
            ckpt.save()
            clock = time.perf_counter()  # the checkpoint's time is no step's
        bar.update(record)
        callbacks.step(record)
        unlogged = record
        if record["step"] % opts.log_every == 0:
            unlogged = None
            callbacks.log(record)

    failed = True
    try:
        while True:
            batch = replay.popleft() if replay else next(source, _END)
            queued = False  # batch is in ckpt.since_last
            try:
                if pending is not None and (batch is _END or ckpt.due(pending.step)):
                    complete()
                if batch is _END:
                    break
                if opts.max_restarts:
                    ckpt.since_last.append(batch)
                    queued = True
                inputs, targets, side = unpack_batch(batch)
                issued = step_async(inputs, targets, **side)
                if pending is not None:
                    complete()
                pending, pending_samples = issued, fed.rows * engine.config.layout.dp if fed else _samples(inputs)
            except (ActorDiedError, PipelineTimeoutError) as e:
                pending = None
                if restarts >= opts.max_restarts:
                    raise
                if not queued and batch is not _END:
                    replay.appendleft(batch)  # it failed before this batch was issued
                restarts += 1
                warn_user(f"restarting the pipeline's actors ({restarts} of max_restarts={opts.max_restarts}) "
                          f"from {ckpt.last} after: {e}")
                history, earlier = _fit_history(ckpt.restart())
                replay = collections.deque(ckpt.take_replay() + list(replay))
                bar.restart_at(earlier + len(history))
                clock, unlogged = time.perf_counter(), None  # the steps since `last` run again
        ckpt.at_end()
        failed = False
    except BaseException as e:
        ckpt.after_failure(e)
        raise
    finally:
        if fed is not None:
            fed.stop()
        _finish(bar, callbacks, unlogged, failed)
    return history


def _finish(bar: Progress, callbacks: CallbackList, unlogged: Optional[dict], failed: bool) -> None:
    """The end of a fit call, also when it raises: the last line, the last step's on_log, on_end."""
    bar.close()
    try:
        if unlogged is not None:
            callbacks.log(unlogged)
    except Exception as e:
        if not failed:
            callbacks.end(raising=True)
            raise
        warn_user(f"a fit callback failed in on_log() of the last step while fit was raising: {e!r}")
    callbacks.end(raising=failed)


def _step_record(result: StepResult, samples: Optional[int], seconds: float,
                 tokens_per_sample: Optional[int]) -> dict:
    """The record of a completed step (Note [fit callbacks] in callbacks.py)."""
    rate = samples / seconds if samples and seconds > 0 else None
    tokens = rate * tokens_per_sample if rate is not None and tokens_per_sample else None
    return {"step": result.step + 1, "loss": result.loss, "grad_norm": result.grad_norm, "lr": result.lr,
            "skipped": result.skipped, "samples": samples, "step_time_s": seconds, "samples_per_s": rate,
            "tokens_per_s": tokens}


def _samples(inputs: Any) -> Optional[int]:
    """The batch's leading dimension (samples, or sequences), None if it has none."""
    try:
        return batch_size(inputs, "inputs")
    except ValueError:
        return None


# Per step, the fields of the records a checkpoint keeps besides the loss (as columns).
_KEPT_FIELDS = ("step", "grad_norm", "lr", "skipped")

# Note [fit's kept history]
# A checkpoint keeps fit's records of the last HISTORY_KEPT steps only, so a save costs the
# same at step 10 and at step 10**6, and ``steps``: how many batches fit had consumed in all.
# A resume skips that many batches and counts its progress from there; the history fit
# returns after a resume starts with the kept steps.  The whole history is what the
# callbacks saw (``CSVLogger``, ``TensorBoardLogger``).  An older manifest without
# ``steps`` kept every step: its count is its history's length.
HISTORY_KEPT = 10_000


def _fit_history(manifest: dict) -> tuple[FitHistory, int]:
    """fit's history at a checkpoint (the kept losses, and records of their kept fields; older
    checkpoints kept the losses only: the steps are counted back from the checkpoint's), and
    how many steps fit had consumed before its first (Note [fit's kept history])."""
    state = manifest.get("fit") or {}
    losses = [float(x) for x in state.get("history", [])]
    columns = state.get("records") or {}
    steps = state.get("steps", len(losses))
    if not isinstance(steps, int) or isinstance(steps, bool) or not len(losses) <= steps:
        raise ValueError(f"the checkpoint's fit state is malformed: {len(losses)} losses kept of steps={steps!r}")
    first = int(manifest["step"]) - len(losses)
    records = []
    for i, loss in enumerate(losses):
        known = {k: v[i] for k, v in columns.items() if k in _KEPT_FIELDS and i < len(v)}
        records.append(_record_of(loss, **{"step": first + i + 1, **known}))
    return FitHistory(losses, records), steps - len(losses)


def _plain(value: Any) -> Any:
    """A record's value as JSON takes it (a numpy or tensor scalar becomes a float)."""
    return value if value is None or isinstance(value, (bool, int, float, str)) else float(value)


def _fit_state(history: FitHistory, earlier: int) -> dict:
    """What a checkpoint keeps of fit: the steps consumed, the last losses and the kept
    fields of their records (Note [fit's kept history])."""
    kept = history.records[-HISTORY_KEPT:]
    columns = {k: [_plain(r.get(k)) for r in kept] for k in _KEPT_FIELDS}
    return {"steps": earlier + len(history), "history": list(history)[-HISTORY_KEPT:], "records": columns}


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
