"""How a ``StageWorker`` process runs: its CPU priority, and the lock that keeps calls
arriving through Ray apart from calls arriving over the step channel."""

from __future__ import annotations

import functools
import inspect
import os
import types
from typing import Optional

__all__ = ["CHANNEL_METHODS", "bypass_ray_wrappers", "match_niceness", "serialize_calls"]

# What the controller may call over the step channel; every other call comes through Ray.
CHANNEL_METHODS = frozenset({"run_call", "take_fill_outputs"})
# Read-only probes that may run while a step does (the profiler's clock probe, liveness).
# ``rebind`` makes a new lock: it runs on a parked actor (no step channel, nothing else
# arriving; Note [reused actors] in mpmd/runtime/pool.py).
_UNLOCKED = frozenset({"pid", "node_id", "clock_ns", "address", "rebind"})


def serialize_calls(cls):
    """Every public method runs under the worker's lock: a Ray call (Ray's thread) and a
    step-channel call (the channel's thread) never run at once (Note [step channel])."""
    def locked(fn):
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            with self.call_lock:
                return fn(self, *args, **kwargs)
        return call

    for name in dir(cls):
        fn = getattr(cls, name)
        if not name.startswith("_") and name not in _UNLOCKED and callable(fn) and not isinstance(fn, type):
            setattr(cls, name, locked(fn))
    return cls


# Note [Ray's method wrappers]: ``ray.remote(cls)`` wraps every method of the actor's class,
# private ones too, in a tracing shim (``ray.util.tracing.tracing_helper._inject_tracing_into_class``)
# that, with tracing off, tests a flag and calls the method: about 0.6 us more per call here
# (a microbenchmark on this 2-core machine), and the interpreter calls several private methods
# per instruction (py-spy on the tiny model shows the shim in every instruction's stack).
# The controller calls public methods only, so the worker binds each private method's own
# function on itself: calls from inside the actor skip the shim, calls through Ray keep it.
def bypass_ray_wrappers(obj) -> None:
    """Bind on ``obj`` the unwrapped function of each private method Ray's shim wraps."""
    for name, fn in inspect.getmembers(type(obj), inspect.isfunction):
        if name.startswith("_") and not name.startswith("__") and getattr(fn, "__ray_tracing_wrapped__", False):
            setattr(obj, name, types.MethodType(fn.__wrapped__, obj))


# Note [worker niceness]: Ray starts its workers at niceness 15 (its `worker_niceness`
# setting) so that its own daemons win the CPU over user code.  For a pipeline that
# puts its own controller, at the controller's niceness, above its own actors: every
# moment the controller unpacks a result or issues the next step (one step in flight),
# it preempts the actor on the critical path, and a peer then waits for that actor.
# The actor raises itself to the controller's niceness in its constructor, so the
# threads it starts later (gloo's, the step channel's) inherit it; Ray's own threads,
# started before, keep Ray's.  Raising priority needs CAP_SYS_NICE: without it the actor
# keeps Ray's niceness and says so in its log.
def match_niceness(target: Optional[int]) -> int:
    """Set this thread's niceness to ``target`` (None: leave it); the niceness in force."""
    current = os.getpriority(os.PRIO_PROCESS, 0)
    if target is None or target == current:
        return current
    try:
        os.setpriority(os.PRIO_PROCESS, 0, target)
    except OSError as e:
        print(f"mpmd: actor keeps niceness {current} (could not take the controller's {target}: {e})", flush=True)
        return current
    return target
