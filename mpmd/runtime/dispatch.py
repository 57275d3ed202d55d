"""Issuing a step's RPCs and turning actor failures into errors within seconds."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from typing import Any, Callable, NamedTuple, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from actors.channel import ChannelAuthError, ChannelClosed
from actors.comm import node_ip
from actors.errors import StageError
from actors.grid import DeviceGrid
from actors.protocol import StepCall, StepReply
from actors.values import pack_batch, to_rpc
from schedules import Schedule

from ..errors import ActorDiedError, PipelineError, PipelineTimeoutError, StageFailedError
from .channels import Call, Channels

__all__ = ["DispatchStats", "Dispatcher", "IssuedStep"]

# After the first failure, how long to collect the others to report the root cause.
_GRACE_S = 1.0
_FREEZE_AT_ACTORS = 256  # Note [a frozen heap at scale]

# Note [a frozen heap at scale]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Each step leaves a few objects per actor alive until it completes (replies, calls), so at
# thousands of actors the garbage collector's oldest generation fills every few steps, and
# each full collection walks the whole heap: torch, Ray and the user's program, a million
# objects.  Measured with ``python -m mpmd bench controller``: 26 us of controller CPU per
# actor per step at 4,096 simulated actors against 18 at 16, and 15-17 at both with those
# collections out of the way.  So a pipeline of _FREEZE_AT_ACTORS actors or more collects
# once when its channels open and moves what is alive then to the permanent generation
# (``gc.freeze``): full collections walk only what came later.  Reference counting still
# frees everything as usual; only a cycle that was alive then and dies later waits for
# ``gc.unfreeze``, which ``close`` calls.


# Note [bare calls]
# ~~~~~~~~~~~~~~~~~
# Only the first and last stages' actors get data in a step call (inputs, targets), and
# only some actors get fill slots or side inputs.  Every other actor gets the same call:
# the step number and "run your whole program" (a step goes over the channels only when
# it is one call per actor; end -1 reads as the program's end, whatever its length).
# That call is pickled once per step and the same bytes go to every such actor, so a
# payload-free actor costs the controller one socket write, whatever the pipeline's
# depth or width (``python -m mpmd bench dispatch`` measures it per actor).

class DispatchStats(NamedTuple):
    """What issuing the last step cost the controller."""

    wall_s: float  # seconds from the first call built to the last sent
    cpu_s: float  # the controller thread's CPU seconds in that time (wall time also counts preemption)
    rpcs: int  # calls issued (one per actor with fusion="step")
    bare: int  # of which sent as one shared message (Note [bare calls])


@dataclasses.dataclass(frozen=True)
class IssuedStep:
    """A step whose RPCs are out: every call, each actor's last call, whose call is whose."""

    step: int
    futures: list
    finals: list
    owner: dict
    channel: bool = False  # the calls went over the step channels (Note [step channel])


class Dispatcher:
    def __init__(self, actors: list, schedule: Schedule, grid: DeviceGrid, on_failure: Callable[[], None]) -> None:
        self.actors, self.schedule, self.grid, self.dp = actors, schedule, grid, grid.dp  # Note [device grid]
        self.on_failure = on_failure  # tears the actors down and closes the channels
        self.num_ranks = schedule.num_ranks
        self._ranks = [grid.rank_of(i) for i in range(len(actors))]  # each actor's pipeline rank
        self.first_rank = schedule.stage_to_rank[0]
        self.last_rank = schedule.stage_to_rank[-1]
        self.last = DispatchStats(0.0, 0.0, 0, 0)
        self.bare_calls = True  # False: pickle every call on its own (for python -m mpmd bench dispatch)
        self._step = -1
        self.channels: Optional[Channels] = None
        self.use_channel = True  # with fusion="step", when the channels are open
        self._ray_in_flight: list = []  # the last step issued as Ray tasks (its final calls)
        self._froze = False  # this dispatcher froze the heap (Note [a frozen heap at scale])

    # -- the step channels (Note [step channel] in actors/channel.py) -----------------------------
    def open_channels(self) -> None:
        key = Channels.new_key()  # over Ray, never on the sockets (Note [step channel])
        here = node_ip()  # an actor on this node listens on loopback
        addresses = self.wait([a.open_channel.remote(key, here) for a in self.actors], "opening the step channels")
        self.attach(Channels([tuple(a) for a in addresses], key))

    def attach(self, channels: Channels) -> None:
        """Send steps over ``channels`` from now on (at scale, with the heap frozen: Note [a frozen
        heap at scale])."""
        self.channels = channels
        if len(self.actors) >= _FREEZE_AT_ACTORS and not self._froze:
            gc.collect()
            gc.freeze()
            self._froze = True

    def close(self) -> None:
        if self.channels is not None:
            self.channels.close()
            self.channels = None
        if self._froze:
            gc.unfreeze()
            self._froze = False

    def call(self, index: int, method: str):
        """Call ``method`` on actor ``index`` after everything issued to it before; ``get`` the result."""
        if self.channels is not None:
            self._order_after_other_path(True)
            return self.channels.send(index, method, ())
        return getattr(self.actors[index], method).remote()

    def get(self, handle, timeout_s: float) -> Any:
        if isinstance(handle, Call):
            if not self.channels.receive([handle], timeout_s):
                raise TimeoutError(f"no reply from actor {handle.actor} within {timeout_s:.0f}s")
            return self.channels.get(handle)
        return ray.get(handle, timeout=timeout_s)

    def _order_after_other_path(self, via_channel: bool) -> None:
        """Calls go out over the channel or as Ray tasks, two queues the actor serves from two
        threads: before switching, wait until what went the other way has finished, so
        every actor runs its calls in the order they were issued."""
        if not via_channel:
            self.quiesce()
            return
        if self._ray_in_flight:
            ray.wait(self._ray_in_flight, num_returns=len(self._ray_in_flight))  # results stay for ray.get
        self._ray_in_flight = []

    def quiesce(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every call sent over the channels has finished (their replies are kept),
        so that a Ray call issued next runs after them, as Ray's own ordering would have it."""
        if self.channels is not None and (out := self.channels.outstanding()):
            self._wait_channel(out, "the steps in flight", timeout_s)

    def issue_step(self, name: str, step: int, mb_in: Optional[list], mb_tg: Optional[list], *, relearn: bool,
                   segments: list, profile: bool = False, collect: bool = False,
                   fills: Optional[list] = None, side: Optional[list] = None) -> "IssuedStep":
        """Issue one step's RPCs without waiting.  Each actor runs its calls in the order
        they were issued, so a step issued before the last one finished queues behind it.

        ``segments[rank]`` are the ``(start, end)`` program ranges of the rank's calls;
        ``fills[i]`` (when given) is actor ``i``'s ``{slot: FillSlot}`` for this step, and
        ``side[i]`` its side inputs (``mpmd/runtime/side.py``)."""
        m = len(mb_in) // self.dp if mb_in is not None else 0  # None: a fed step (actors/feed.py)
        finals, futures, owner = [], [], {}
        t0, c0 = time.perf_counter(), time.thread_time()
        payloads = {}  # actor index -> (inputs, targets), only for the actors that get data
        for i in range(len(self.actors)) if mb_in is not None else ():
            replica, rank, _ = self.grid.coord(i)  # every TP and CP rank of a stage gets its data
            if rank != self.first_rank and rank != self.last_rank:
                continue
            inputs = mb_in[replica * m:(replica + 1) * m] if rank == self.first_rank else None
            targets = mb_tg[replica * m:(replica + 1) * m] if mb_tg is not None and rank == self.last_rank else None
            payloads[i] = (pack_batch(inputs), pack_batch(targets))
        # Any size goes over the channel: the controller never blocks writing (Note [channel outbox]).
        via_channel = self.channels is not None and self.use_channel and all(len(s) == 1 for s in segments)
        self._order_after_other_path(via_channel)
        bare, num_bare = None, 0  # the step's call to every payload-free actor, pickled once (Note [bare calls])
        # Over the channels every call is pickled before any is sent: one that does not pickle
        # raises here with no actor started on the step.
        encoded = []  # (actor index, the call's bytes, whether it is the actor's last)
        for i, actor in enumerate(self.actors):
            rank = self._ranks[i]
            inputs, targets = payloads.get(i, (None, None))
            fill, mine = (fills[i] if fills else None), (side[i] if side else None)
            segs = segments[rank]
            if via_channel and self.bare_calls and i not in payloads and not fill and not mine:
                if bare is None:  # one call is the whole program (start 0, end -1: to its end)
                    bare = Channels.message("run_call", (tuple(StepCall(name, step, relearn, profile, collect)),
                                                         None, None, None, None))
                encoded.append((i, bare, True))
                num_bare += 1
                continue
            if not via_channel:
                inputs, targets = to_rpc(inputs), to_rpc(targets)  # see actors/values.py
            for start, end in segs:
                first = start == 0
                call = StepCall(name, step, relearn, profile, collect, start, end, end == segs[-1][1])
                args = (tuple(call), inputs if first else None, targets if first else None,  # Note [plain tuples
                        fill if first else None, mine if first else None)  # on the wire] in actors/protocol.py
                if via_channel:
                    encoded.append((i, self.channels.encode(i, "run_call", args), end == segs[-1][1]))
                    continue
                fut = actor.run_call.remote(*args)
                futures.append(fut)
                owner[fut] = i
            if not via_channel:
                finals.append(futures[-1])
        for i, message, last in encoded:
            fut = self.channels.send_built(i, message)
            futures.append(fut)
            owner[fut] = i
            if last:
                finals.append(fut)
        if not via_channel:
            self._ray_in_flight = list(finals)
        self.last = DispatchStats(time.perf_counter() - t0, time.thread_time() - c0, len(futures), num_bare)
        return IssuedStep(step, futures, finals, owner, via_channel)

    def finish_step(self, issued: "IssuedStep", timeout_s: Optional[float]) -> list[StepReply]:
        """Wait for an issued step's RPCs; each actor's reply, in actor order."""
        self._step = issued.step
        if issued.channel:
            self._wait_channel(issued.futures, f"step {issued.step}", timeout_s)
            replies = [self.channels.get(f) for f in issued.finals]
        else:
            self.wait(issued.futures, f"step {issued.step}", timeout_s=timeout_s, owner=issued.owner)
            replies = ray.get(issued.finals)
        return [StepReply._make(r) for r in replies]

    def _wait_channel(self, calls: list, what: str, timeout_s: Optional[float]) -> None:
        """``wait`` for calls sent over the channels: each wake-up looks only at the replies it
        read (Note [channels at scale] in channels.py).  A dead actor's channel closes (its
        process's socket at once, a silent node's within ``LIVENESS_S``), so no actor is polled."""
        channels = self.channels

        def ready(pending: set, timeout: Optional[float]) -> list:
            done = [c for c in channels.poll(timeout) if c in pending]
            pending.difference_update(done)
            return done

        self._await(calls, what, timeout_s, ready=ready, done=channels.done, failure=channels.failure,
                    owner=lambda c: c.actor)

    def wait(self, futures: list, what: str, timeout_s: Optional[float] = None,
             owner: Optional[dict] = None) -> list[Any]:
        """Wait for ``futures``; on the first failure tear the pipeline down and raise."""
        owner = owner if owner is not None else {f: self._actor_index(f, futures) for f in futures}

        def ready(pending: set, timeout: Optional[float]) -> list:
            done, _ = ray.wait(list(pending), num_returns=1, timeout=timeout)
            pending.difference_update(done)
            return done

        self._await(futures, what, timeout_s, ready=ready, done=None, failure=_failure, owner=owner.get)
        return ray.get(futures)

    def _await(self, calls: list, what: str, timeout_s: Optional[float], *, ready: Callable,
               done: Optional[Callable], failure: Callable, owner: Callable) -> None:
        """Wait until every call is done, Ray task or channel call alike.

        ``ready(pending, timeout)`` waits up to ``timeout`` seconds (None: no limit) for calls of
        the set ``pending`` to finish, removes those from it and returns them; ``done(call)``
        (when given) says whether a call had finished before the wait; ``failure(call)`` is a
        done call's exception or None; ``owner(call)`` its actor's index.  The first failure
        waits ``_GRACE_S`` for the others' (the root cause may be among them), tears the
        pipeline down and raises; so does running past ``timeout_s``."""
        deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
        finished = [c for c in calls if done(c)] if done is not None else []
        pending = set(calls).difference(finished)
        while True:
            errors = [(e, owner(c)) for c in finished if (e := failure(c)) is not None]
            if errors:
                end = time.monotonic() + _GRACE_S
                while pending and (left := end - time.monotonic()) > 0:
                    errors += [(e, owner(c)) for c in ready(pending, left) if (e := failure(c)) is not None]
                self.on_failure()
                raise self._describe(errors, what)
            if not pending:
                return
            if time.monotonic() >= deadline:
                self.on_failure()
                raise PipelineTimeoutError(f"{what} did not finish within {timeout_s:.1f}s; the actors were torn down")
            finished = ready(pending, None if deadline == math.inf else max(0.0, deadline - time.monotonic()))

    def _actor_index(self, fut, futures) -> Optional[int]:
        # Without an owner map, only "one call per actor, in actor order" says whose call it is.
        return futures.index(fut) if len(futures) == len(self.actors) else None

    def _describe(self, errors: list, what: str) -> PipelineError:
        # Root cause first: a dead actor explains its peers' broken connections.
        def rank_of(err):
            exc, _ = err
            if isinstance(exc, ChannelAuthError):  # a forged frame: what follows from it is no root cause
                return -1
            if isinstance(exc, (RayActorError, ChannelClosed)):
                return 0
            if isinstance(exc, StageError) and not _is_comm_error(exc):
                return 1
            return 2

        exc, idx = sorted(errors, key=rank_of)[0]
        rank = self.grid.rank_of(idx) if idx is not None else -1
        stages = self.schedule.stages_of(rank) if rank >= 0 else ()
        replica = self.grid.replica_of(idx) if idx is not None else -1
        if isinstance(exc, ChannelAuthError):  # not a death: the actor lives, its connection was tampered with
            error = PipelineError(
                f"{exc} (rank {rank}, replica {replica}, stages {list(stages)}) during {what}; the actor did not die: "
                f"a frame on its step channel was forged, altered or replayed, so the pipeline's actors "
                f"were torn down. Find what else can write to that address, "
                f"or set step_channel=False to send steps through Ray only")
            error.__cause__ = exc
            return error
        if isinstance(exc, (RayActorError, ChannelClosed)):
            return ActorDiedError(
                f"the actor of rank {rank} (replica {replica}, stages {list(stages)}) died during {what}; "
                f"the pipeline's other actors were torn down. Cause: {exc}",
                rank=rank, stages=tuple(stages), step=self._step)
        if isinstance(exc, StageError):
            return StageFailedError(f"{exc}\n\nactor traceback:\n{exc.actor_traceback}", rank=exc.rank,
                                    stage=exc.stage, step=exc.step, instruction=exc.instruction,
                                    actor_traceback=exc.actor_traceback, in_loss=exc.in_loss)
        return PipelineError(f"{what} failed: {exc}")


def _failure(fut) -> Optional[BaseException]:
    try:
        ray.get(fut, timeout=0)
    except RayTaskError as e:
        cause = e.cause if getattr(e, "cause", None) is not None else e
        return cause
    except RayActorError as e:
        return e
    except GetTimeoutError:
        return None
    return None


def _is_comm_error(exc: StageError) -> bool:
    text = str(exc).lower()
    return any(w in text for w in ("connection", "gloo", "nccl", "timed out", "timeout", "peer"))
