"""Where each actor's step goes: compute, waiting on a peer, communication work, data, the
optimizer and the actor's own overhead (pure: no Ray).

Note [where a step goes]
------------------------
A profiled step's reply carries the actor's step window: from the call that began the step
entering ``StageWorker.run_call`` to the reply being built, on the actor's host clock (what
the step channel and Ray do around the call is outside it).  The window is split into:

* compute: the ``F``, ``B``, ``I`` and ``W`` slices;
* wait: the time the actor was blocked waiting for a point-to-point operation to complete
  (``Communicator.blocked_ns``, read around each instruction: a receive waiting for its
  message, the step's sends awaited after its program, ``FLUSH``).  On gloo a receive's
  bytes are read off the socket by gloo's own thread while the actor waits, so the wait
  holds the transfer as well as the peer's lateness: the transport cannot tell them apart.
  On CUDA, NCCL's wait returns at once (it orders the stream, Note [device timing]): the
  host never blocks, and a receive's device interval, its stream's wait for the data
  included, counts as comm;
* comm: the rest of the point-to-point slices (allocating and posting receives, the
  receive prefetch's bookkeeping, staging copies, headers) and the collectives
  (``ALLREDUCE``, ``TIE_REDUCE``, ``ALLGATHER``), whose waiting and work are not told apart
  (gloo runs a collective on the calling thread);
* data: a fed step's batch (``DATA``); optimizer: ``OPT``; fill: PipeFill chunks (``FILL``);
* own: the rest of the window, the actor's own overhead: setting the step up and building
  its reply, the interpreter between instructions (the loop, the timer's marks, dispatch on
  the instruction's kind), and ``FREE`` instructions (bookkeeping).  The step's set-up also
  posts its first receives (Note [receive prefetch]): that posting counts in own, the
  receives posted later in the slices of the sends and receives that post them.  Python inside an
  instruction (argument handling around a module call) counts with that instruction's
  slice, so own is what the actor spends outside every instruction.

``own_per_instruction``: own over the program instructions executed.  On a shared machine the
wall clock also counts the time the actor was preempted; ``own_cpu`` counts only the actor
thread's CPU time in own (its window's CPU time less its entries' but ``FREE``'s, by
``time.thread_time_ns``), the figure to compare across runs on a loaded machine.  Both
include the profiler's own marks (a few clock readings per instruction).  Per instruction
kind, ``KindOwn`` gives the mean slice and the mean own time before it (from the end of the
entry before it on the actor's timeline); the step's set-up and reply (before its first
entry and after its last) is a row of its own, so the rows' own add up to the actors'.

A stage's overlapped dp reduction (``DP_REDUCE``) overlaps instructions and is in none of
these.  With ``fusion`` other than ``"step"`` own also holds the time between the step's
calls (the controller's dispatch).  On CUDA the slices are the device's intervals (Note
[device timing] in actors/timing.py) and the window the host's: own is then the window's
time in which the device ran no recorded instruction.
"""

from __future__ import annotations

from collections import defaultdict
from typing import NamedTuple, Sequence

from .slices import COMM, COMPUTE, DATA, DPREDUCE, FILL, OPT, OWN, P2P, Slice

__all__ = ["ActorSplit", "KindOwn", "SETUP", "split_steps"]

SETUP = "step set-up and reply"  # KindOwn's row of the window before the first entry and after the last


class ActorSplit(NamedTuple):
    """One actor's step window and its parts, seconds per step (means over the profiled steps);
    ``compute + wait + comm + data + optimizer + fill + own == window``."""

    window: float
    compute: float
    wait: float
    comm: float
    data: float
    optimizer: float
    fill: float
    own: float
    instructions: float  # program instructions executed per step
    own_cpu: float = 0.0  # the actor thread's CPU time in own (the window's less its entries' but FREE's)

    @property
    def own_per_instruction(self) -> float:
        return self.own / self.instructions if self.instructions else 0.0

    @property
    def own_cpu_per_instruction(self) -> float:
        return self.own_cpu / self.instructions if self.instructions else 0.0


class KindOwn(NamedTuple):
    """Per instruction kind, over every actor: how many run per step, their mean slice, and
    the mean own time before each (for ``FREE``, its slice too: Note [where a step goes])."""

    kind: str
    count: float  # per step, all actors together
    slice_seconds: float
    wait_seconds: float  # of the slice, blocked waiting for a peer
    own_seconds: float


def split_steps(slices: Sequence[Slice], windows: dict, num_actors: int,
                steps: int) -> tuple[tuple[ActorSplit, ...], tuple[KindOwn, ...]]:
    """Each actor's ``ActorSplit`` and the kinds' ``KindOwn`` rows; ``windows[(step, actor)]``
    is the actor's ``(start_ns, end_ns, cpu_ns, slices_cpu_ns)`` (``StepReply.window``, the
    clock the controller's).  Empty without windows."""
    if not windows:
        return (), ()
    by_step_actor: dict[tuple[int, int], list[Slice]] = defaultdict(list)
    for s in slices:
        if s.kind != DPREDUCE:
            by_step_actor[(s.step, s.actor)].append(s)
    parts = [[0.0] * 10 for _ in range(num_actors)]  # summed over steps, ActorSplit's order
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])  # kind -> [count, slice s, wait s, own s]
    for (k, a), (start, end, cpu, slices_cpu) in windows.items():
        run = sorted(by_step_actor[(k, a)], key=lambda s: s.start_ns)
        window = (end - start) * 1e-9
        compute = sum(s.seconds for s in run if s.kind in COMPUTE)
        wait = sum(_waited(s) for s in run)
        comm = sum(s.seconds for s in run if s.kind in COMM) - wait
        data = sum(s.seconds for s in run if s.kind == DATA)
        opt = sum(s.seconds for s in run if s.kind == OPT)
        fill = sum(s.seconds for s in run if s.kind == FILL)
        own = window - compute - wait - comm - data - opt - fill
        executed = sum(s.index >= 0 for s in run)
        for j, v in enumerate((window, compute, wait, comm, data, opt, fill, own, executed, (cpu - slices_cpu) * 1e-9)):
            parts[a][j] += v
        before, setup = start, kinds[SETUP]
        for j, s in enumerate(run):
            row = kinds[s.kind]
            row[0] += 1
            row[1] += s.seconds
            row[2] += _waited(s)
            row[3] += s.seconds if s.kind in OWN else 0.0
            (setup if j == 0 else row)[3] += max(0, s.start_ns - before) * 1e-9  # the set-up precedes the first
            before = max(before, s.end_ns)
        setup[0] += 1
        setup[3] += max(0, end - before) * 1e-9
    split = tuple(ActorSplit(*(v / steps for v in p)) for p in parts)
    rows = sorted((KindOwn(kind, n / steps, sl / n, w / n, own / n) for kind, (n, sl, w, own) in kinds.items()),
                  key=lambda r: -r.count * r.own_seconds)
    return split, tuple(rows)


def _waited(s: Slice) -> float:
    """Seconds of ``s`` its actor was blocked waiting for a peer (the host's reading, at most the slice)."""
    return min(s.wait_ns, s.end_ns - s.start_ns) * 1e-9 if s.kind in P2P else 0.0
