"""Staged sends without stopping the actor (Note [staged transport] in actors/comm.py).

A staged send copies the tensor into pinned host memory with a non-blocking copy and
records an event after it; gloo must not read the buffer before that event.  Waiting on
the actor's thread would stop it queueing the next kernels (the next microbatch's forward)
until the copy is done, once per message.  Instead one sender thread per actor takes the
buffers in posted order, waits for each one's event and hands it to gloo's ``isend``; the
actor's thread goes on at once.  Every staged send of the actor (shape headers too) goes
through the thread, so each peer still gets its messages in posted order.  ``flush`` waits
for what the thread issued (``DeferredWork.wait``).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional

import torch

__all__ = ["StagedSender", "DeferredWork"]


class DeferredWork:
    """A send the sender thread will issue; ``wait`` as a ``torch.distributed`` work."""

    def __init__(self) -> None:
        self._issued = threading.Event()
        self._work: Any = None
        self._error: Optional[BaseException] = None

    def issued(self, work: Any = None, error: Optional[BaseException] = None) -> None:
        """Called by the sender thread: the send is out (``work``), or failed (``error``)."""
        self._work, self._error = work, error
        self._issued.set()

    def is_completed(self) -> bool:
        return self._issued.is_set() and (self._error is not None or self._work.is_completed())

    def wait(self) -> bool:
        self._issued.wait()
        if self._error is not None:
            raise RuntimeError(f"a staged send failed: {self._error}") from self._error
        return self._work.wait()


class StagedSender:
    """One thread issuing ``isend(tensor, dst)`` for staged buffers once their copy is done."""

    def __init__(self, isend: Callable[[torch.Tensor, int], Any]) -> None:
        self._isend = isend
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="staged-sender")
        self._thread.start()

    def send(self, ready: Any, tensor: torch.Tensor, dst: int) -> DeferredWork:
        """``ready``: the event recorded after the copy into ``tensor`` (None: already there)."""
        work = DeferredWork()
        self._queue.put((ready, tensor, dst, work))
        return work

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            ready, tensor, dst, work = item
            try:
                if ready is not None:
                    ready.synchronize()  # this thread waits for the copy, not the actor's
                work.issued(self._isend(tensor, dst))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the send
                work.issued(error=e)

    def close(self) -> None:
        self._queue.put(None)
