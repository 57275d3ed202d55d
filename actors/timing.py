"""Time on the actor's device, not the time to launch its kernels.

Note [device timing]
--------------------
On CUDA a kernel launch returns at once, and so do NCCL's ``recv`` and ``wait`` (they order
the compute stream, not the host): a host clock around an instruction measures the launch.
A ``DeviceTimer`` times the device instead, in two ways, each used only while measuring:

* ``mark()`` / ``resolve()`` (instruction timelines, ``profile=True`` steps): a CUDA event
  recorded on the current stream at each mark; ``begin()`` synchronises once and pairs a
  host reading with a first event, and ``resolve()`` synchronises once at the step's end and
  turns each event into host-clock nanoseconds (first reading + elapsed device time).  A
  profiled step synchronises twice, not once per instruction; the busy time is the
  kernels' (a receive's interval holds the stream's wait for its data).
* ``seconds()``: synchronise, then read the host clock, so an interval ends when the work
  queued in it has.  The device's timer (``device_timer``) waits for the whole device, every
  stream, NCCL's too, so it is read only where nothing is posted: link probes, between steps.
  Fill chunks run inside a step, beside posted receives and sends: they run on a stream of
  their own and their timer (``stream_timer``) waits for that stream only.  Waiting for the
  device there would wait for the slot's own receive (every chunk after it skipped) and for
  posted sends whose peers may be in a fill slot too (a hang).  A profiled step
  synchronises the device at its start, before it posts anything, and at its end, after
  its sends completed: no step waits for the device while something it posted is pending.

Note [device sync]
On NCCL a device-wide synchronisation waits for every posted send and receive, so one inside
a step can hang.  ``actors/`` synchronises the device in one place, ``device_timer``'s
``synchronize`` (``torch.cuda.synchronize``), reached only from: ``begin`` (a profiled
step's start, before it pulls a fed batch or posts a receive), ``resolve`` (its end, after
``flush`` and the agreed update) and ``seconds`` in ``probe_links`` (between steps).  So
nothing of the step is pending at ``begin``; a fed step's targets, sent to the last stage
before the program starts, are received as the first thing that actor does and wait on
nothing of the sender's: a later sync can be delayed by them, never hang.  tests/actors/test_timing.py checks the call sites.

On the CPU both are the host clock and nothing synchronises.  ``synchronize``, ``event``
and the clocks are injected, so the CUDA path is tested on the CPU with fakes that record
when they synchronise (tests/actors/test_timing.py).
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Optional

import torch

__all__ = ["DeviceTimer", "device_timer", "stream_timer"]


class DeviceTimer:
    def __init__(self, *, synchronize: Optional[Callable[[], None]] = None, event: Optional[Callable[[], Any]] = None,
                 wall_ns: Callable[[], int] = time.time_ns, perf: Callable[[], float] = time.perf_counter) -> None:
        """``synchronize``: waits for the device (None: the host is the device); ``event``: a new
        timing event with ``record()`` and ``elapsed_time(other)`` in ms (None: host marks)."""
        self._sync, self._event, self._wall_ns, self._perf = synchronize, event, wall_ns, perf
        self._origin: Optional[tuple[int, Any]] = None

    def seconds(self) -> float:
        """The host clock once the device's queued work is done."""
        if self._sync is not None:
            self._sync()
        return self._perf()

    def begin(self) -> None:
        """Before a profiled step's first mark: pairs the host clock with the device's."""
        if self._event is None:
            return
        self._sync()
        first = self._event()
        first.record()
        self._origin = (self._wall_ns(), first)

    def mark(self) -> Any:
        """A point in the device's work; ``resolve`` turns it into host-clock nanoseconds."""
        if self._event is None:
            return self._wall_ns()
        ev = self._event()
        ev.record()
        return ev

    def resolve(self, timeline: list) -> list:
        """``timeline``'s ``(what, start mark, end mark)`` entries in host-clock nanoseconds."""
        if self._event is None or not timeline:
            return timeline
        if self._origin is None:
            raise RuntimeError("DeviceTimer.resolve without begin(): no host time to anchor the events to")
        self._sync()
        wall0, first = self._origin
        at = lambda ev: wall0 + int(round(first.elapsed_time(ev) * 1e6))  # noqa: E731 - ms to ns
        return [(what, at(a), at(b)) for what, a, b in timeline]


@functools.lru_cache(maxsize=None)
def device_timer(device: torch.device) -> DeviceTimer:
    """The timer of ``device`` (one per device)."""
    if device.type != "cuda":
        return DeviceTimer()
    return DeviceTimer(synchronize=functools.partial(torch.cuda.synchronize, device),
                       event=functools.partial(torch.cuda.Event, enable_timing=True))


def stream_timer(device: torch.device) -> tuple[DeviceTimer, Optional[Any]]:
    """A timer of work on a new stream of ``device`` and the stream (None on the CPU): it waits
    for that stream only (fill chunks: Note [device timing])."""
    if device.type != "cuda":
        return DeviceTimer(), None
    stream = torch.cuda.Stream(device)
    event = functools.partial(torch.cuda.Event, enable_timing=True)
    return DeviceTimer(synchronize=stream.synchronize, event=event), stream
