"""The messages between the controller and a ``StageWorker``: named, typed, small.

One step is one ``StepCall`` per actor (with ``fusion="step"``; the other fusion modes
cut the program into several calls); each actor answers the call that ends its step
with a ``StepReply``.  PipeFill rides along: the controller hands a rank's fill slots
``{slot: FillSlot}`` with the call that starts the step, and the reply carries one
``ChunkResult`` per chunk.  They are ``NamedTuple``s: a field read by name cannot
silently pick up the wrong position.

Note [plain tuples on the wire]: ``StepCall`` and ``StepReply`` cross the process
boundary (over the step channel or as Ray tasks) as plain tuples, ``tuple(call)``, and
are rebuilt with ``StepCall._make`` on the other side: pickling a ``NamedTuple`` looks
its class up by name, which measured 1.1-2.9 us more per message than a tuple here,
on the controller's dispatch path and on each actor's critical path, every step.
Fill chunks and chunk results travel as they are (only steps with fill work carry them).

Setting an actor up takes two messages, once per pipeline (and ``StageSetup`` again on
``reschedule``): ``CommSetup`` forms its process groups (``StageWorker.init_comm``),
``StageSetup`` gives it its stages and how to train them (``StageWorker.setup``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

from .update import Recipe

__all__ = ["CommSetup", "StageSetup", "StepCall", "StepReply", "FillChunk", "FillSlot", "ChunkResult", "TieGroup", "OPTIMIZER_STEP", "ALL_GATHER",
           "FEED", "FLUSH", "DP_REDUCE", "dp_reduce_entry", "dp_reduce_position", "TimelineEntry"]

# A profiled step's timeline entry for the optimizer step (instead of a program position).
OPTIMIZER_STEP = -1
ALL_GATHER = -2  # ZeRO-1's all-gather after the optimizer step (Note [ZeRO-1 sharding] in actors/zero.py)
FEED = -3  # a fed step's batch, read or received before the program runs (Note [fed steps] in actors/feed.py)
FLUSH = -4  # the step's sends awaited after its program (Communicator.flush)
DP_REDUCE = -5  # at or below: a stage's overlapped dp reduction (Note [overlapped dp reduction] in actors/dp_reduce.py)


def dp_reduce_entry(position: int) -> int:
    """The timeline entry of the dp reduction that the ``ALLREDUCE`` at ``position`` waited for."""
    return DP_REDUCE - position


def dp_reduce_position(entry: int) -> int:
    """The position of the ``ALLREDUCE`` of a ``dp_reduce_entry``."""
    return DP_REDUCE - entry


# (program position, OPTIMIZER_STEP, ALL_GATHER, FEED, FLUSH or a DP_REDUCE entry, start_ns, end_ns)
TimelineEntry = tuple


class StepCall(NamedTuple):
    """Run instructions ``[start, end)`` of the program named ``program`` for step ``step``.

    ``start == 0`` begins the step (the first stage's inputs and the last stage's
    targets come with it); ``last`` ends it (flush sends, optimizer step) and answers
    with a ``StepReply``.  ``relearn``: shapes travel in headers this step.  ``profile``:
    record a timeline.  ``collect``: return the last stage's outputs instead of a loss.
    """

    program: str
    step: int
    relearn: bool = False
    profile: bool = False
    collect: bool = False
    start: int = 0
    end: int = -1  # -1: to the end of the program
    last: bool = True


class FillChunk(NamedTuple):
    """Inputs ``start .. start + n`` of fill job ``job``; ``predicted_s`` its predicted time."""

    job: int
    start: int
    n: int
    predicted_s: float


class FillSlot(NamedTuple):
    """What one ``FILL`` slot runs this step: chunks, started while ``budget_s`` has room."""

    budget_s: float
    chunks: tuple[FillChunk, ...]


class ChunkResult(NamedTuple):
    """A chunk's outcome: run (``error`` is its traceback if it raised) or ``skipped``
    (not started: no room left in its slot), with the seconds it took."""

    job: int
    start: int
    n: int
    seconds: float = 0.0
    error: Optional[str] = None
    skipped: bool = False


class StepReply(NamedTuple):
    """One actor's answer to the call that ends a step."""

    losses: list  # per microbatch of the last stage on this actor: the unscaled loss
    timeline: list  # TimelineEntry per executed instruction when profiled, else empty
    skipped: bool = False  # the actors agreed not to step the optimizer (on_nan="skip")
    outputs: Optional[list] = None  # collect=True: the last stage's output per microbatch
    fills: tuple = ()  # ChunkResult per fill chunk handed to this step
    grad_norm: Optional[float] = None  # the global gradient norm before clipping, when clipping
    lr: Optional[float] = None  # the learning rate this step used (this actor's first stage)
    # Profiled steps (Note [where a step goes] in mpmd/profiler/split.py): the actor's step window,
    # ``(start_ns, end_ns, cpu_ns, slices_cpu_ns)``: on its host clock, from the call that began the
    # step entering ``run_call`` to this reply being built; the thread's CPU time in the step's
    # calls, and of it in the timeline's entries but FREE; and ``(timeline position, ns)`` per
    # timeline entry during which the actor was blocked in the transport's wait
    # (``Communicator.blocked_ns``).
    window: tuple = ()
    waited: tuple = ()
    # MoE blocks watched (actors/experts.py ``finish_step``): ``{metric name: value}`` of this actor's
    # stages after the step (per-expert loads as lists, aux losses as floats); replica 0, TP rank 0 only
    moe: Optional[dict] = None
    # Profiled steps: the expert all-to-alls (``actors.experts.ExchangeLog``) as ``(program
    # position, start_ns, end_ns, what, issued_ns)`` on the actor's host clock (start: when the
    # issuing side was held up, issued: when it was issued; Note [hidden all-to-all]).
    exchanges: tuple = ()


class TieGroup(NamedTuple):
    """Parameters stages share, as one actor sees them (``setup``; Note [tie reduction] in
    ``schedules/passes.py``): each local stage's names of the shared parameters, in one
    order across stages and actors, and the index of the communicator's group for the
    tie (-1 when every stage of the tie lives on this actor)."""

    index: int  # the tie's index: the lowered program's TIE_REDUCE names it
    names: dict  # local stage -> tuple of parameter names
    group: int = -1
    owner: int = -1  # the tie's first stage: its copy alone enters the gradient norm


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommSetup:
    """How an actor joins the pipeline's process groups (``StageWorker.init_comm``); the same
    message for every actor, so the controller puts it into Ray's store once (Note [start-up
    at scale] in mpmd/runtime/cluster.py).  Groups are lists of global ranks (Note [device grid]
    in actors/grid.py)."""

    world_size: int
    address: tuple[str, int]  # the rendezvous: actor 0's free port (``StageWorker.address``)
    backend: str  # "gloo" or "nccl"
    timeout_s: float
    dp_groups: list[list[int]]
    tie_groups: list[list[int]] = dataclasses.field(default_factory=list)  # Note [tie reduction]
    p2p_groups: list[list[int]] = dataclasses.field(default_factory=list)  # Note [point-to-point groups]
    # Note [expert parallelism] in actors/grid.py: the all-to-alls' groups and the experts' gradient sums'
    ep_groups: list[list[int]] = dataclasses.field(default_factory=list)
    edp_groups: list[list[int]] = dataclasses.field(default_factory=list)
    staged: bool = False  # Note [staged transport] in actors/comm.py
    queued: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageSetup:
    """An actor's stages and how it trains them (``StageWorker.setup``).

    ``modules``: stage -> the module pickled on its own (``bytes``), so that stages sharing
    a parameter each get their own copy (``ties``: the ``TieGroup``s of the local stages;
    Note [tie reduction] in schedules/passes.py), or a ``StageFactory`` built on the actor
    (Note [stage factories] in actors/build.py); or a Ray reference to that dict, put once
    per pipeline rank and read on the actor (a reference inside a message is not resolved
    by Ray the way an argument is).  ``overlap_reduce``: with ``dp > 1``, each stage's
    gradient average starts inside its last backward (Note [overlapped dp reduction] in
    actors/dp_reduce.py).  ``side_takes`` / ``loss_takes``: the side inputs each stage's
    forward and the loss take by keyword (None: all; mpmd/runtime/side.py)."""

    modules: Any
    optimizer: Callable  # params -> torch.optim.Optimizer, one per stage
    loss_fn: Optional[Callable]
    num_stages: int
    num_microbatches: int  # per replica
    bucket_bytes: int
    ties: tuple = ()
    side_takes: Optional[dict] = None
    loss_takes: Optional[tuple] = ()
    document_mask: bool = False  # attention within documents (Note [context-parallel runtime] in actors/cp_runtime.py)
    recipe: Recipe = Recipe()
    lr_scheduler: Optional[Callable] = None
    dp: int = 1
    zero: int = 0
    tp_plans: Optional[dict] = None  # stage -> its TP plan (Note [tensor parallelism] in actors/tensor_parallel.py)
    overlap_reduce: bool = True
