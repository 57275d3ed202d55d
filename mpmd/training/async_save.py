"""Saves in flight: ``pipe.save(path, blocking=False)`` and ``fit(..., checkpoint_async=True)``
(Note [asynchronous save] in ``checkpoint.py``).

A ``PendingSave`` watches the checkpoint's temporary directory, in a thread of the
controller, for the marker each actor's writer leaves when its shard is written or has
failed; once every shard is done it writes the manifest and renames the directory into
place.  At most one save per pipeline is in flight; a failure not yet raised to anyone is
raised at the next step, save, load, or the end of ``fit``."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Callable, Optional

import ray
from ray.exceptions import RayActorError

from actors.checkpoint_io import DONE, FAILED, done_marker, failed_marker

from ..errors import ActorDiedError, PipelineError
from ..runtime import Engine
from .atomic import abort

__all__ = ["CheckpointError", "PendingSave", "track", "wait_for_save", "raise_failed_save", "abandon_save"]

# How often the watcher asks the actors still writing whether they live (a dead writer
# leaves no marker), and the longest pause between two looks at the directory.
_PROBE_S = 1.0
_MAX_POLL_S = 0.05


class CheckpointError(PipelineError):
    """A checkpoint could not be written or read; ``path`` is the checkpoint's.  Nothing was
    written at ``path`` by a save that raised this: a checkpoint there before is intact."""

    def __init__(self, message: str, *, path: str) -> None:
        super().__init__(message)
        self.path = path


class PendingSave:
    """An asynchronous save: the actors hold a copy of their state (taken when it was issued)
    and write it while training goes on.  ``done()``; ``wait(timeout)`` (True once it ended,
    written or failed, without raising); ``result(timeout)`` the path, or raises its failure.
    The checkpoint at ``path`` appears, whole, only when the save is complete."""

    def __init__(self, engine: Engine, path: str, tmp: str, writers: list[int], finish: Callable[[], None]) -> None:
        self.path, self.reported = path, False
        self._engine, self._actors, self._tmp = engine, engine.fleet.actors, tmp
        self._writers, self._finish = list(writers), finish
        self._error: Optional[BaseException] = None
        self._done, self._stop = threading.Event(), threading.Event()
        threading.Thread(target=self._run, name="mpmd-checkpoint-finalizer", daemon=True).start()

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error is not None else "complete"
        return f"PendingSave({self.path!r}, {state})"

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: Optional[float] = None) -> bool:
        return self._done.wait(timeout)

    def result(self, timeout: Optional[float] = None) -> str:
        if not self._done.wait(timeout):
            raise TimeoutError(f"the asynchronous save to {self.path} did not finish within {timeout}s")
        if self._error is not None:
            self.reported = True
            raise self._error
        return self.path

    def raise_unreported(self) -> None:
        """Raise the failure of this (finished) save unless someone had it already."""
        if self._error is not None and not self.reported:
            self.reported = True
            raise self._error

    def abandon(self) -> Optional[str]:
        """Stop waiting (the actors are gone: ``fit``'s restart); the path if the save had
        completed, else None (its failure is then nobody's to raise)."""
        self._stop.set()
        self._done.wait()
        self.reported = True
        return self.path if self._error is None else None

    # -- the watcher's thread ----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._wait_for_shards()
            self._finish()
        except BaseException as e:  # noqa: BLE001 - kept for whoever asks next
            self._error = e
            abort(self._tmp)
        finally:
            self._done.set()

    def _wait_for_shards(self) -> None:
        """Until every writer has ended; then its failures, if any, are raised.  A writer that
        failed does not end the wait: the others may still be writing into the directory,
        which goes only when nobody writes there any more."""
        pending, probes, failures = set(self._writers), {}, []
        poll, probe_at = 0.002, time.monotonic() + _PROBE_S
        while pending:
            if self._stop.is_set():
                raise CheckpointError(f"the asynchronous save to {self.path} was abandoned", path=self.path)
            names = set(os.listdir(self._tmp))
            failed = [i for i in sorted(pending) if failed_marker(i) in names]
            failures += [self._read_failure(i) for i in failed]
            pending -= set(failed) | {i for i in pending if done_marker(i) in names}
            if not pending:
                break
            if self._engine.fleet.closed or self._engine.fleet.actors is not self._actors:
                raise CheckpointError(f"the asynchronous save to {self.path} was abandoned: the pipeline's actors "
                                      f"were torn down (an actor failed, or shutdown()) before actors "
                                      f"{sorted(pending)} had written their shards", path=self.path)
            if time.monotonic() >= probe_at:
                pending -= self._probe(pending, probes, failures)
                probe_at = time.monotonic() + _PROBE_S
            self._stop.wait(poll)
            poll = min(poll * 1.5, _MAX_POLL_S)
        if failures:
            raise self._failure(failures)

    def _read_failure(self, index: int) -> str:
        try:
            with open(os.path.join(self._tmp, failed_marker(index))) as f:
                return f.read()
        except OSError as e:
            return f"actor {index} failed writing its shard (its failure marker cannot be read: {e})"

    def _failure(self, errors: list[str]) -> CheckpointError:
        more = f" (and {len(errors) - 1} more: {'; '.join(errors[1:])})" if len(errors) > 1 else ""
        return CheckpointError(f"the asynchronous save to {self.path} failed: {errors[0]}{more}; nothing was "
                               f"written at {self.path} (a checkpoint there before is intact)", path=self.path)

    def _probe(self, pending: set, probes: dict, failures: list) -> set:
        """Ask the actors still writing how it goes (one call each in flight); those that
        ended without a marker (a failure goes into ``failures``).  A dead actor's call
        fails: ``ActorDiedError``."""
        finished = set()
        for i in sorted(pending):
            ref = probes.get(i)
            if ref is None:
                probes[i] = self._engine.client.shard_status(self._actors[i])
                continue
            if not ray.wait([ref], timeout=0)[0]:
                continue
            del probes[i]
            try:
                status, error = ray.get(ref)
            except RayActorError as e:
                rank = self._engine.rank_of(i)
                raise ActorDiedError(f"the actor of rank {rank} (replica {i // self._engine.num_ranks}) died while "
                                     f"writing its shard of the checkpoint {self.path}; nothing was written at "
                                     f"{self.path}. Cause: {e}", rank=rank,
                                     stages=tuple(self._engine.schedule.stages_of(rank)), step=-1) from None
            if status == FAILED:
                failures.append(error)
            if status in (DONE, FAILED):
                finished.add(i)
        return finished


# The save in flight of each pipeline's engine (at most one).
_IN_FLIGHT: "weakref.WeakKeyDictionary[Engine, PendingSave]" = weakref.WeakKeyDictionary()


def track(engine: Engine, save: PendingSave) -> None:
    _IN_FLIGHT[engine] = save


def wait_for_save(engine: Engine) -> None:
    """Wait for ``engine``'s save in flight, if any, and raise its failure if nobody had it."""
    save = _IN_FLIGHT.pop(engine, None)
    if save is not None:
        save.wait()
        save.raise_unreported()


def raise_failed_save(engine: Engine) -> None:
    """Raise the failure of ``engine``'s asynchronous save if it has ended so and nobody had it
    (each step asks: a cheap look, no waiting)."""
    save = _IN_FLIGHT.get(engine)
    if save is not None and save.done():
        del _IN_FLIGHT[engine]
        save.raise_unreported()


def abandon_save(engine: Engine) -> Optional[str]:
    """Forget ``engine``'s save in flight (its actors are gone); its path if it had completed."""
    save = _IN_FLIGHT.pop(engine, None)
    return save.abandon() if save is not None else None
