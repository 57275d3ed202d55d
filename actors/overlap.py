"""One microbatch's forward and another's backward on one actor, overlapped: the forward runs in
the actor's thread, the backward in a second, persistent thread, and a baton lets exactly one
of them compute at any time.

Note [overlap turns]
~~~~~~~~~~~~~~~~~~~~
DualPipe's point (DeepSeek-V3, section 3.2.1) is that an expert all-to-all of one microbatch
travels while another microbatch computes.  Here the two halves of an ``OVERLAP`` instruction
(a forward ``F`` and a backward ``B`` or ``I``) take turns at the expert exchanges
(actors/exchange.py): a side that reaches an exchange first waits for the baton (it has it,
unless it is an autograd device thread that ran ahead), issues the all-to-all asynchronously,
hands the baton to the other side and waits for it back; only then does it wait for its
exchange to finish.  So the exchange travels while the other side computes up to its own next
exchange (or its end), and

* exactly one side computes at a time: the same kernels, on the same intra-op threads, as
  forward-then-backward (bit-identical on CPU), and no oversubscription;
* the order is a function of the program alone - the forward starts, then the sides alternate
  at each exchange, and a side that has finished no longer takes turns - so every member of an
  expert-parallel group issues its exchanges in the same order (what gloo's tags and NCCL's one
  stream need, and what the order model checks before launch);
* a side that raises hands the baton on for good; the other side runs to its end alone and the
  forward's thread re-raises the first error.

Which side is calling is told by the thread: the forward's is the actor's; any other thread
(the backward's, or on CUDA the autograd engine's device thread working for it) is the
backward's.  Per-thread state the backward needs is carried over: grad mode, the context
variables (``actors.experts.loss_scale``) and, on CUDA, the current device and stream.
"""

from __future__ import annotations

import contextvars
import queue
import threading
from typing import Callable, Optional

import torch

__all__ = ["Baton", "Overlapper", "running_baton", "FORWARD", "BACKWARD"]

FORWARD, BACKWARD = 0, 1
_RUNNING: Optional["Baton"] = None  # the overlap this process runs now (an actor runs one step at a time)


def running_baton() -> Optional["Baton"]:
    """The baton of the overlap in progress, or None outside one (Note [overlap turns])."""
    return _RUNNING


class Baton:
    """Which side of one overlap may compute (Note [overlap turns])."""

    def __init__(self, forward_thread: int) -> None:
        self.forward_thread = forward_thread
        self.holder = FORWARD
        self.done = [False, False]
        self.turns = 0  # hand-overs at exchanges, for tests and the profile
        self._cond = threading.Condition()

    def side(self) -> int:
        return FORWARD if threading.get_ident() == self.forward_thread else BACKWARD

    def hold(self) -> None:
        """Wait until the calling side has the baton."""
        me = self.side()
        with self._cond:
            self._cond.wait_for(lambda: self.holder == me)

    def turn(self) -> None:
        """At an exchange just issued: let the other side compute until it gives the baton
        back (at its next exchange or its end); at once when the other side has finished."""
        me = self.side()
        with self._cond:
            if self.done[1 - me]:
                return
            self.holder = 1 - me
            self.turns += 1
            self._cond.notify_all()
            self._cond.wait_for(lambda: self.holder == me)

    def finish(self, side: int) -> None:
        """``side`` has ended (or failed): the other side has the baton for good."""
        with self._cond:
            self.done[side] = True
            self.holder = 1 - side
            self._cond.notify_all()


class _ThreadState:
    """What a thread of torch keeps for itself and the backward side must run with."""

    def __init__(self) -> None:
        self.grad = torch.is_grad_enabled()
        self.context = contextvars.copy_context()
        self.cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            self.cuda = (device, torch.cuda.current_stream(device))

    def run(self, fn: Callable[[], None]) -> None:
        if self.cuda is not None:
            torch.cuda.set_device(self.cuda[0])
            torch.cuda.set_stream(self.cuda[1])
        with torch.set_grad_enabled(self.grad):
            self.context.run(fn)


class Overlapper:
    """Runs overlaps for one actor: ``run(forward, backward)`` returns when both have ended,
    having run them interleaved at the expert exchanges (Note [overlap turns]).  The backward's
    thread is started at the first overlap and kept."""

    def __init__(self) -> None:
        self._jobs: "queue.Queue[Optional[tuple]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self.last: Optional[Baton] = None  # the last overlap's baton (its ``turns``)
        self.failed: Optional[int] = None  # the side whose error the last overlap raised (FORWARD, BACKWARD)

    def run(self, forward: Callable[[], None], backward: Callable[[], None]) -> None:
        global _RUNNING
        if _RUNNING is not None:
            raise RuntimeError("an overlap inside an overlap: each runs one forward and one backward")
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="mpmd-overlap-backward", daemon=True)
            self._thread.start()
        baton, self.failed = Baton(threading.get_ident()), None
        self.last = baton
        ended = threading.Event()
        failed: list = [None, None]
        _RUNNING = baton
        try:
            self._jobs.put((baton, backward, _ThreadState(), failed, ended))
            try:
                forward()
            except BaseException as e:  # noqa: BLE001 - re-raised below, once the backward has ended
                failed[FORWARD] = e
            finally:
                baton.finish(FORWARD)
            ended.wait()
        finally:
            _RUNNING = None
        self.failed = FORWARD if failed[FORWARD] is not None else BACKWARD if failed[BACKWARD] is not None else None
        if self.failed is not None:
            raise failed[self.failed]

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            baton, backward, state, failed, ended = job
            try:
                baton.hold()
                state.run(backward)
            except BaseException as e:  # noqa: BLE001 - handed to the forward's thread
                failed[BACKWARD] = e
            finally:
                baton.finish(BACKWARD)
                ended.set()

    def close(self) -> None:
        """End the backward's thread (a process kept for another pipeline gets a new one)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None
