"""``fit``'s callbacks: what each completed step reports, and the loggers that write it.

Note [fit callbacks]
A callback is an object with any of three methods (``Callback`` documents them; subclassing
it is optional), or a plain function, which is taken as ``on_step``:

    on_step(record)  every completed step, in order
    on_log(record)   every ``log_every``-th step (``record["step"] % log_every == 0``) and
                     the last step of the fit call, once: what loggers write
    on_end()         once, when fit returns *or raises*; close files here

``record`` is a dict, one per step (see ``STEP_FIELDS``): ``step`` (the pipeline's step count
after it, 1-based: the ``N`` of the checkpoint ``step-N`` taken right after it), ``loss``,
``grad_norm`` (None unless ``clip_grad_norm`` is on), ``lr`` (None if unknown), ``skipped``,
``samples`` (the batch's leading dimension), ``step_time_s`` (the interval between this
step's completion and the previous one's; fit keeps one step in flight, Note [one step in
flight] in ``fit.py``; time spent writing a checkpoint is not counted), ``samples_per_s``
and ``tokens_per_s`` (``fit(..., tokens_per_sample=seq_len)``; else None).

After a restart (``max_restarts``) the steps since the last checkpoint run again, so a
callback sees their step numbers again; the loggers below then drop what they had written
from that step on, as they do when fit resumes from a checkpoint.

Errors: an exception from ``on_step``/``on_log`` stops training and leaves fit as it is
(with a note naming the callback and the step); first every callback's ``on_end`` runs, the
raising one's too.  An exception from ``on_end`` is raised after the other ``on_end`` calls
(if fit is already raising, it becomes a warning).
"""

from __future__ import annotations

import csv
import os
from typing import Any, Callable, Optional, Union

from ..runtime.checks import warn_user

__all__ = ["Callback", "CSVLogger", "TensorBoardLogger", "CallbackList", "STEP_FIELDS"]

# The keys of every step's record, in the order CSVLogger writes them.
STEP_FIELDS = ("step", "loss", "grad_norm", "lr", "skipped", "samples", "step_time_s", "samples_per_s",
               "tokens_per_s")


class Callback:
    """The callback protocol of ``fit`` (Note [fit callbacks]); every method is optional."""

    def on_step(self, record: dict) -> None:
        """Every completed step."""

    def on_log(self, record: dict) -> None:
        """Every ``log_every``-th step and the last one of the fit call."""

    def on_end(self) -> None:
        """The end of the fit call, also when it raises."""


class CallbackList:
    """The callbacks of one fit call, called in the order given (Note [fit callbacks])."""

    def __init__(self, callbacks: Any) -> None:
        if callbacks is None:
            callbacks = ()
        elif _is_callback(callbacks) and not isinstance(callbacks, (list, tuple)):
            callbacks = (callbacks,)
        if not isinstance(callbacks, (list, tuple)):
            raise ValueError(f"callbacks must be a list of callbacks, got {callbacks!r}")
        for i, cb in enumerate(callbacks):
            if not _is_callback(cb):
                raise ValueError(f"callbacks[{i}] ({cb!r}) is not a callback: pass a function of the step's record, "
                                 "or an object with on_step(record) and/or on_log(record) (and optionally on_end()), "
                                 "e.g. mpmd.training.CSVLogger('metrics.csv')")
        self.callbacks = tuple(callbacks)

    def __len__(self) -> int:
        return len(self.callbacks)

    def step(self, record: dict) -> None:
        """``record`` to every ``on_step`` (a function: called)."""
        for cb in self.callbacks:
            _call(cb, cb if _is_function(cb) else getattr(cb, "on_step", None), record)

    def log(self, record: dict) -> None:
        """``record`` to every ``on_log``."""
        for cb in self.callbacks:
            _call(cb, None if _is_function(cb) else getattr(cb, "on_log", None), record)

    def end(self, raising: bool) -> None:
        """Every ``on_end``; the first error is raised after all ran, or warned when ``raising``."""
        first: Optional[BaseException] = None
        for cb in self.callbacks:
            hook = None if _is_function(cb) else getattr(cb, "on_end", None)
            if hook is None:
                continue
            try:
                hook()
            except Exception as e:
                if raising:
                    warn_user(f"the fit callback {cb!r} failed in on_end() while fit was raising: {e!r}")
                elif first is None:
                    first = e
        if first is not None:
            raise first


def _call(cb: Any, hook: Optional[Callable[[dict], None]], record: dict) -> None:
    if hook is None:
        return
    try:
        hook(record)
    except BaseException as e:
        if hasattr(e, "add_note"):  # Python 3.11+
            e.add_note(f"(raised by the fit callback {cb!r} at step {record.get('step')})")
        raise


def _is_function(cb: Any) -> bool:
    return callable(cb) and not any(hasattr(cb, h) for h in ("on_step", "on_log", "on_end"))


def _is_callback(cb: Any) -> bool:
    return callable(cb) or hasattr(cb, "on_step") or hasattr(cb, "on_log")


class _StepLogger(Callback):
    """A logger of steps that rewrites what it wrote from a step run again: a fit's first step
    (a resume goes on from a checkpoint, maybe before the output's end) and a step after a
    restart.  Subclasses open their output with ``_open(first)``, dropping what it holds from
    step ``first`` on, write with ``_write(record)`` and close with ``_close()``."""

    def __init__(self) -> None:
        self._seen: Optional[int] = None  # the last step on_step saw
        self._first: Optional[int] = None  # the output must be rewritten from this step on
        self._opened = False

    def on_step(self, record: dict) -> None:
        step = int(record["step"])
        if self._seen is None or step <= self._seen:
            self._first = step if self._first is None else min(self._first, step)
        self._seen = step

    def on_log(self, record: dict) -> None:
        step = int(record["step"])
        if not self._opened or self._first is not None:
            self._close()
            self._open(min(step, self._first) if self._first is not None else step)
            self._opened, self._first = True, None
        self._write(record)

    def on_end(self) -> None:
        self._close()
        self._seen, self._first, self._opened = None, None, False

    def _open(self, first: int) -> None:
        raise NotImplementedError

    def _write(self, record: dict) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


# -- CSV -----------------------------------------------------------------------------------------------
class CSVLogger(_StepLogger):
    """Writes a row per logged step (``on_log``: every ``log_every``-th step and the last) to
    the CSV file ``path``: the header once, then the record's fields (``STEP_FIELDS``; None
    is an empty cell), each row flushed so a crash leaves the rows written.

    An existing file is appended to (its header kept): a fit that resumes from a checkpoint
    goes on where the file ends.  Its rows from the fit's first step on (rows a crashed run
    wrote after its last checkpoint; all of them when a new run starts at step 1) and the
    rows of steps run again after a restart are dropped first, so the file holds each step
    once, in order."""

    def __init__(self, path: Union[str, os.PathLike]) -> None:
        super().__init__()
        self.path = os.fspath(path)
        self._file = None
        self._writer: Optional[csv.DictWriter] = None
        self._header: Optional[list[str]] = None

    def _open(self, first: int) -> None:
        header, rows = self._read()
        at = header.index("step") if header is not None else 0
        kept = [r for r in rows if header is not None and len(r) == len(header)
                and _int_or_none(r[at]) is not None and _int_or_none(r[at]) < first]
        self._header = header
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", newline="") as f:
            if header is not None:
                csv.writer(f).writerows([header, *kept])
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", newline="")

    def _write(self, record: dict) -> None:
        if self._writer is None:
            if self._header is None:  # a new file: the header from the first record
                self._header = [f for f in STEP_FIELDS if f in record] + [f for f in record if f not in STEP_FIELDS]
                csv.writer(self._file).writerow(self._header)
            self._writer = csv.DictWriter(self._file, fieldnames=self._header, extrasaction="ignore", restval="")
        self._writer.writerow(record)
        self._file.flush()

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._writer, self._header = None, None, None

    def _read(self) -> tuple[Optional[list[str]], list[list[str]]]:
        directory = os.path.dirname(self.path)
        if directory:
            os.makedirs(directory, exist_ok=True)
        if not os.path.isfile(self.path) or os.path.getsize(self.path) == 0:
            return None, []
        with open(self.path, newline="") as f:
            lines = list(csv.reader(f))
        if not lines or "step" not in lines[0]:
            raise ValueError(f"{self.path} exists and is not a CSV of fit's steps (no 'step' column in its header "
                             f"{lines[0] if lines else []}); give CSVLogger a new path")
        return lines[0], [row for row in lines[1:] if row]

    def __repr__(self) -> str:
        return f"CSVLogger({self.path!r})"


def _int_or_none(text: str) -> Optional[int]:
    try:
        return int(text)
    except ValueError:
        return None


# -- TensorBoard -----------------------------------------------------------------------------------------
class TensorBoardLogger(_StepLogger):
    """Writes every number of a logged step's record (``on_log``: every ``log_every``-th step
    and the last) as the scalar ``train/<field>`` at its step, with
    ``torch.utils.tensorboard.SummaryWriter`` into ``log_dir`` (``tensorboard --logdir ...``);
    ``writer_options`` go to the SummaryWriter.  Needs the ``tensorboard`` package:
    ``pip install 'mpmd[tensorboard]'``.

    The writer opens with ``purge_step`` at the fit's first step (and again at a step run
    again after a restart), so TensorBoard hides what an earlier run wrote from there on."""

    def __init__(self, log_dir: Union[str, os.PathLike], **writer_options: Any) -> None:
        super().__init__()
        try:  # lazily: tensorboard is an optional extra
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("TensorBoardLogger needs the tensorboard package: pip install 'mpmd[tensorboard]' "
                              f"(or pip install tensorboard); importing it failed with: {e}") from e
        self.log_dir = os.fspath(log_dir)
        self._make_writer: Callable[..., Any] = SummaryWriter
        self._options = writer_options
        self._writer = None

    def _open(self, first: int) -> None:
        self._writer = self._make_writer(self.log_dir, purge_step=first, **self._options)

    def _write(self, record: dict) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)):
                self._writer.add_scalar(f"train/{key}", float(value), step)

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        self._writer = None

    def __repr__(self) -> str:
        return f"TensorBoardLogger({self.log_dir!r})"
