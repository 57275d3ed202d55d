"""Actors kept between pipelines: ``mpmd.reuse_actors()`` (Note [reused actors])."""

from __future__ import annotations

import threading
from typing import Any, Optional

import ray

__all__ = ["ActorPool", "reuse_actors", "active_pool"]


# Note [reused actors]: an actor is a new process that imports Ray, torch and the runtime
# before it can take a stage.  On this project's 2-core machine the test suite spent 2931 s
# of its 3532 s in Engine.start for 673 actors (4.4 s each), more than its pipelines then
# spent training; every pipeline a notebook rebuilds, and each option schedule="auto" tries
# on the actors, pays it again.
# While an ActorPool is active (`with mpmd.reuse_actors():`), a pipeline that shuts down
# cleanly parks its actors instead of killing them (StageWorker.park in actors/worker.py: an
# asynchronous write finishes, the feed, step channel and process groups close, modules,
# optimizers, programs and compiled graphs go), and the next pipeline's launch takes parked actors and rebinds
# them (the constructor runs again: its grid place, seed and niceness), starting processes
# only for the rest.
#
# What a process keeps across a rebind, and why that is the same training: imported modules
# (a stage's class is imported by name either way; a module file edited in between is not read
# again), the random state of Python's `random` and numpy (the runtime seeds neither, so a
# fresh process has no fixed value either), torch's thread count (set from OMP_NUM_THREADS
# when the process started: the pool keeps actors apart by that variable), the count of TP
# meshes it made (each gets a new name, below), and its heap: freed memory a process keeps
# counts in its resident size, and the peak RSS that memory_stats reports (the kernel's
# VmHWM) starts again at the rebind from that size.
#
# What is not reused: a pipeline that fails or is interrupted (its actors are killed, as
# without a pool); a pipeline that started Ray itself (its shutdown ends Ray); GPU pipelines (a
# process's GPU is fixed when Ray starts it); spares (Note [spare actors]).  A tensor-parallel
# stage on a reused process gets a mesh of another name than the last one's (actors/
# tensor_parallel.py, tp_mesh): DTensor's process-wide caches compare meshes by ranks and
# names, not process groups.  DTensor's RNG tracker (state that would carry over) is made only
# on CUDA-like meshes, which are never reused.  Actors a pool can
# take run outside the pipeline's placement group, with num_cpus=0 and the thread count the
# group's CPUs give, as spares do: removing a placement group kills the actors in it.  The
# group is still created with the same bundles, so the CPUs stay reserved.
class ActorPool:
    """Idle ``StageWorker`` processes, parked by pipelines that shut down, taken by the next."""

    def __init__(self, max_idle: int = 8) -> None:
        if not isinstance(max_idle, int) or max_idle < 0:
            raise ValueError(f"max_idle must be an int >= 0 (how many idle actors to keep), got {max_idle!r}")
        self.max_idle = max_idle
        self._idle: list[tuple[Any, Any]] = []  # (key, actor handle), oldest first
        self._session: Optional[str] = None  # the Ray session the handles belong to
        self.taken = 0  # actors handed to pipelines since the pool was made
        self.parked = 0

    def __len__(self) -> int:
        return len(self._idle)

    def _same_session(self) -> None:
        """Forget handles from an earlier Ray session (its processes are gone)."""
        session = ray.get_runtime_context().gcs_address if ray.is_initialized() else None
        if session != self._session:
            self._idle, self._session = [], session

    def take(self, key: Any, count: int) -> list:
        """Up to ``count`` live parked actors started with ``key``, removed from the pool."""
        self._same_session()
        mine = [a for k, a in self._idle if k == key][:count]
        if not mine:
            return []
        self._idle = [(k, a) for k, a in self._idle if all(a is not m for m in mine)]
        pings = {a.pid.remote(): a for a in mine}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=5.0)
        alive = []
        for ping, actor in pings.items():
            try:
                if ping in ready:
                    ray.get(ping)
                    alive.append(actor)
                    continue
            except ray.exceptions.RayActorError:
                pass
            _kill(actor)
        self.taken += len(alive)
        return alive

    def give(self, key: Any, actors: list, timeout_s: float = 10.0) -> list:
        """Park ``actors`` (started with ``key``) and keep as many as fit; one that fails to park is
        killed.  The ones not asked (no room), to stop."""
        self._same_session()
        room = max(0, self.max_idle - len(self._idle))
        calls = {a.park.remote(): a for a in actors[:room]}
        if calls:
            ready, _ = ray.wait(list(calls), num_returns=len(calls), timeout=timeout_s)
            for call, actor in calls.items():
                try:
                    parked = call in ready and bool(ray.get(call))
                except Exception:  # noqa: BLE001 - an actor that cannot park is killed, not kept
                    parked = False
                if parked:
                    self._idle.append((key, actor))
                    self.parked += 1
                else:
                    _kill(actor)
        return actors[room:]

    def close(self) -> None:
        """Stop reusing actors; kill the idle ones."""
        _deactivate(self)
        for _, actor in self._idle:
            _kill(actor)
        self._idle = []

    def __enter__(self) -> "ActorPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# The active pools, innermost last.  A process-wide stack, not an argument of each Pipeline:
# the pool belongs to the process's one Ray connection (ray.init is process-wide too), and
# turning reuse on for a notebook or a test session should not change every call site.
_lock = threading.Lock()
_active: list[ActorPool] = []


def reuse_actors(max_idle: int = 8) -> ActorPool:
    """From now on (or within ``with mpmd.reuse_actors():``), pipelines of this process that
    shut down cleanly keep up to ``max_idle`` of their CPU actors for the next pipeline, which
    starts only the processes it still lacks (Note [reused actors]).  ``pool.close()``, or
    leaving the ``with`` block, kills the idle ones and stops reusing; ``reuse_actors(0)``
    inside one starts fresh processes again."""
    pool = ActorPool(max_idle)
    with _lock:
        _active.append(pool)
    return pool


def _deactivate(pool: ActorPool) -> None:
    with _lock:
        if pool in _active:
            _active.remove(pool)


def active_pool() -> Optional[ActorPool]:
    """The pool pipelines started now use, if any (``max_idle=0``: none)."""
    with _lock:
        pool = _active[-1] if _active else None
    return pool if pool is not None and pool.max_idle > 0 else None


def _kill(actor) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
