"""NCCL's point-to-point order on the CPU: one queue per communicator (``transport="nccl-order"``,
whose operations ``NcclOrderTransport`` in actors/transports.py hands to ``PairQueues``).

Note [NCCL order on the CPU]
----------------------------
No machine here has two GPUs, so NCCL between two actors never runs in a test.  To run
the actors' real posting order under NCCL's semantics (Note [NCCL order] in
schedules/posting.py), this transport sends over gloo but executes every point-to-point
operation issued on one process group on one thread, in the order the actor posted it,
each blocking that queue until matched, both directions together, as the group's one NCCL
stream does: a pair's own group (Note [point-to-point groups] in actors/comm.py) is one
queue per pair; operations issued on the world group share one queue for every peer, as
they share one stream under eager initialisation:

* a send first waits for the peer's ready token (sent when the peer's matching receive
  reaches the head of *its* queue), then sends the data: a send holds its queue until
  the peer's receive is there;
* a receive sends the ready token, then waits for the data: it holds its queue until the
  peer's send is there.

Tokens and data travel under different tags, each pair's k-th with k-th.  Two sends (or
two receives) at the heads of a pair's queues wait for each other until the group's
timeout, which becomes an error naming the rank and instruction, never a hang.
Collectives run on the calling thread, as on their own NCCL stream.
"""

from __future__ import annotations

import queue
import threading
from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["PairQueues", "QueuedWork"]

_DATA, _READY = 0, 1  # gloo tags


class QueuedWork:
    """One queued operation; ``wait`` and ``is_completed`` as a ``torch.distributed`` work."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: Optional[BaseException] = None

    def finish(self, error: Optional[BaseException] = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise RuntimeError(f"a point-to-point operation failed in NCCL's order: {self._error}") from self._error
        return True


class PairQueues:
    """Point-to-point operations with each peer run in posted order on one thread per peer."""

    def __init__(self) -> None:
        self._queues: dict[int, queue.SimpleQueue] = {}
        self._lock = threading.Lock()

    def isend(self, tensor: torch.Tensor, dst: int, group=None) -> QueuedWork:
        return self._submit(dst, "send", tensor, group)

    def irecv(self, tensor: torch.Tensor, src: int, group=None) -> QueuedWork:
        return self._submit(src, "recv", tensor, group)

    def _submit(self, peer: int, op: str, tensor: torch.Tensor, group) -> QueuedWork:
        """Queue ``op`` on the stream of the group it is issued on (``None``: the world group,
        whose one stream serves every peer: Note [point-to-point groups] in actors/comm.py)."""
        key = id(group) if group is not None else None
        with self._lock:
            q = self._queues.get(key)
            if q is None:
                q = self._queues[key] = queue.SimpleQueue()
                name = f"pair-queue-{peer}" if group is not None else "world-queue"
                threading.Thread(target=_serve, args=(q,), daemon=True, name=name).start()
        work = QueuedWork()
        q.put((op, peer, tensor, work))
        return work

    def close(self) -> None:
        with self._lock:
            for q in self._queues.values():
                q.put(None)
            self._queues = {}


def _serve(q: queue.SimpleQueue) -> None:
    token = torch.zeros(1, dtype=torch.uint8)
    broken: Optional[BaseException] = None
    while (item := q.get()) is not None:
        op, peer, tensor, work = item
        if broken is not None:
            work.finish(broken)  # the stream is stuck behind a failed operation, as on a GPU
            continue
        try:
            if op == "send":
                dist.recv(token, peer, tag=_READY)
                dist.send(tensor, peer, tag=_DATA)
            else:
                dist.send(token, peer, tag=_READY)
                dist.recv(tensor, peer, tag=_DATA)
        except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the work
            broken = e
            work.finish(e)
            continue
        work.finish()
