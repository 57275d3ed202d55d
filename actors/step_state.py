"""What lives for one step on a worker (``Interpreter.current``, actors/interpreter.py)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .stage_exec import Slot

__all__ = ["StepState"]


@dataclasses.dataclass
class StepState:
    """What lives for one step on a worker; a new one begins each step (``Interpreter``'s ``_begin``)."""

    program: str = ""
    step: int = -1
    relearn: bool = False
    profile: bool = False
    train: bool = False
    collect: bool = False
    inputs: Optional[list] = None  # the first stage's microbatches
    targets: Optional[list] = None  # the last stage's
    side: dict = dataclasses.field(default_factory=dict)  # name -> per-microbatch values
    side_whole: dict = dataclasses.field(default_factory=dict)  # name -> one value for every microbatch
    fills: dict = dataclasses.field(default_factory=dict)  # FILL slot index -> FillSlot
    slots: dict = dataclasses.field(default_factory=dict)  # buffer id -> Slot
    losses: list = dataclasses.field(default_factory=list)
    outputs: dict = dataclasses.field(default_factory=dict)  # microbatch -> last stage's output (collect)
    timeline: list = dataclasses.field(default_factory=list)
    waited: list = dataclasses.field(default_factory=list)  # (timeline position, ns blocked in the transport)
    # (position, start_ns, end_ns, what, issued_ns): expert all-to-alls (Note [hidden all-to-all])
    exchanges: list = dataclasses.field(default_factory=list)
    entered_ns: int = 0  # when the call that began the step entered ``run_call`` (profiled steps)
    cpu_ns: int = 0  # this thread's CPU time in the step's calls before the last one (profiled steps)
    slices_cpu_ns: int = 0  # of the step's CPU time, in its timeline's entries but FREE (profiled steps)
    fill_results: list = dataclasses.field(default_factory=list)  # ChunkResult per chunk handed out
    posted: dict = dataclasses.field(default_factory=dict)  # program position -> posted receive
    peers: list = dataclasses.field(default_factory=list)  # per program position, the actor at the other end
    next_recv: int = 0  # index of the program's next receive
    pc: int = 0  # position of the instruction running
    shards: Any = None  # StepShards under CP or document masking (Note [context-parallel runtime])
    gathered: Any = None  # the timer's mark where ZeRO-1's all-gather began (profiled steps)

    def slot(self, buf: int) -> Slot:
        """Buffer ``buf``'s slot, made on first use."""
        slot = self.slots.get(buf)
        if slot is None:
            slot = self.slots[buf] = Slot()
        return slot

    def side_kwargs(self, takes: Optional[tuple], mb: int) -> dict:
        """The side inputs of microbatch ``mb`` whose names ``takes`` lists (None: all), on the device."""
        kwargs = {n: v[mb] for n, v in self.side.items() if takes is None or n in takes}
        kwargs.update((n, v) for n, v in self.side_whole.items() if takes is None or n in takes)
        return kwargs
