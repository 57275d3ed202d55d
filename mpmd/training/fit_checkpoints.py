"""``fit``'s checkpoints: the one a restart goes back to, the batches consumed since (replayed
after a restart), the ones this call wrote (``keep_checkpoints`` prunes them), and with
``checkpoint_async`` the save in flight.

Note [fit's last checkpoint]: a restart must go back to a *complete* checkpoint.  A blocking
save is complete when it returns, so it becomes ``last`` at once and the batches before it
are forgotten.  An asynchronous one becomes ``last`` only once it is complete (looked at
after every step, waited for before the next save and at the end); until then ``last`` stays
the one before, and the batches consumed since *that* one stay to be replayed: the save
remembers how many of them it covers and drops only those when it completes.  Checkpoints
are pruned only when a newer one is complete, so ``last`` is never pruned."""

from __future__ import annotations

import os
import re
import shutil
from typing import Callable, Optional

from ..runtime import Engine
from ..runtime.checks import warn_user
from .checkpoint import CheckpointError, PendingSave, checkpoint_name, checkpoints_newest_first, load_checkpoint, \
    read_manifest, save_checkpoint

__all__ = ["FitCheckpoints"]

_LEFTOVER = re.compile(r"^\.step-(\d+)\.(tmp|old)-")  # a dead save's ".step-N.tmp-*" or ".step-N.old-*"


class FitCheckpoints:
    """See the module docstring.  ``state()`` gives the ``fit_state`` kept in each checkpoint."""

    def __init__(self, engine: Engine, *, directory: Optional[str], every: Optional[int], keep: Optional[int],
                 asynchronous: bool, state: Callable[[], dict]) -> None:
        self.engine, self.directory, self.every, self.keep = engine, directory, every, keep
        self.asynchronous, self.state = asynchronous, state
        self.last: Optional[str] = None  # the newest complete checkpoint: a restart goes back to it
        self.since_last: list = []  # batches consumed since `last`
        self.written: list[str] = []  # complete checkpoints this call wrote, oldest first
        self.saving: Optional[tuple[PendingSave, int]] = None  # in flight, and how many of since_last it covers

    def resume(self) -> Optional[dict]:
        """Load the newest readable checkpoint under the directory, if any; its manifest.  One
        that cannot be read (a damaged manifest or file) is passed over with a warning, and the
        next newest loaded; when none can, the newest's error is raised."""
        failure: Optional[CheckpointError] = None
        for found in checkpoints_newest_first(self.directory):
            try:
                manifest = load_checkpoint(self.engine, found)  # one that fails leaves the pipeline as it was
            except CheckpointError as e:
                warn_user(f"resuming: the checkpoint {found} cannot be read ({e}); trying the one before it")
                failure = failure or e
                continue
            self.last = found
            return manifest
        if failure is not None:
            raise CheckpointError(f"no checkpoint under {self.directory} could be read; the newest: {failure}",
                                  path=failure.path) from failure
        return None

    def due(self, step: int) -> bool:
        return bool(self.every) and (step + 1) % self.every == 0

    def save(self, *, blocking: bool = False) -> None:
        """A checkpoint of the state now (``step-N``): ``last`` at once, or, asynchronous (and
        not ``blocking``), once complete."""
        self.settle(wait=True)  # at most one in flight; its failure is raised here
        path = os.path.join(self.directory, checkpoint_name(self.engine.step_count))
        if blocking or not self.asynchronous:
            self._completed(save_checkpoint(self.engine, path, fit_state=self.state()), len(self.since_last))
        else:
            self.saving = (save_checkpoint(self.engine, path, fit_state=self.state(), blocking=False),
                           len(self.since_last))

    def settle(self, *, wait: bool) -> None:
        """The save in flight, if it has ended (``wait``: once it has), becomes ``last``, or raises."""
        if self.saving is None or not (wait or self.saving[0].done()):
            return
        (pending, covered), self.saving = self.saving, None
        self._completed(pending.result(), covered)

    def _completed(self, path: str, covered: int) -> None:
        self.last, self.since_last = path, self.since_last[covered:]
        if path in self.written:
            self.written.remove(path)
        self.written.append(path)
        while self.keep is not None and len(self.written) > self.keep:
            shutil.rmtree(self.written.pop(0), ignore_errors=True)
        self._sweep()

    def _sweep(self) -> None:
        """Remove what saves that died left in the directory: temporary directories (no save of
        this pipeline is in flight now) and the ``.old`` copies a newer checkpoint supersedes
        (Note [atomic checkpoint])."""
        newest = int(os.path.basename(self.last)[len("step-"):])  # checkpoint_name(step)
        for name in os.listdir(self.directory):
            m = _LEFTOVER.match(name)
            if m and (m.group(2) == "tmp" or int(m.group(1)) <= newest):
                shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

    def restart(self) -> dict:
        """Fresh actors from ``last`` (its manifest); ``since_last`` is what to replay."""
        if self.saving is not None:  # its actors are gone; it counts only if it had completed
            (pending, covered), self.saving = self.saving, None
            done = pending.abandon()
            if done is not None:
                self._completed(done, covered)
        self.engine.fleet.restart()
        return load_checkpoint(self.engine, self.last)

    def take_replay(self) -> list:
        batches, self.since_last = self.since_last, []
        return batches

    def at_end(self) -> None:
        """Every checkpoint complete (a failure raised), and one of the final state."""
        self.settle(wait=True)
        if self.directory is not None and (self.last is None or
                                           read_manifest(self.last)["step"] != self.engine.step_count):
            self.save(blocking=True)

    def after_failure(self, error: BaseException) -> None:
        """fit is raising ``error``: let the save in flight complete (not on Ctrl-C), saying so
        if it failed too."""
        if self.saving is None:
            return
        (pending, _), self.saving = self.saving, None
        if isinstance(error, KeyboardInterrupt):
            pending.abandon()
            return
        pending.wait()
        if not pending.reported:
            try:
                pending.result()
            except Exception as e:  # noqa: BLE001 - fit raises its own error
                warn_user(f"the asynchronous checkpoint {pending.path} failed too: {e}")
