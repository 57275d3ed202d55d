"""The unit of a profile: one executed instruction on the controller's clock, and the
kinds of time it is accounted as."""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["Slice", "A2A", "COMPUTE", "COMM", "P2P", "OPT", "ALLGATHER", "DATA", "DPREDUCE", "FLUSHED", "FILL", "OWN"]

COMPUTE = frozenset({"F", "B", "I", "W", "OVERLAP"})  # OVERLAP: a forward and a backward together
OPT = "OPT"  # the optimizer step, after a training step's program
ALLGATHER = "ALLGATHER"  # ZeRO-1's all-gather after the optimizer step
DATA = "DATA"  # a fed step's batch read (or received, sent on) by the actor before its program
FLUSHED = "FLUSH"  # the step's sends awaited after its program
FILL = "FILL"  # PipeFill chunks in a fill slot
A2A = "A2A"  # an expert all-to-all inside a compute instruction (ProfileReport.all_to_all)
OWN = frozenset({"FREE"})  # instructions that are the actor's own bookkeeping (Note [where a step goes] in split.py)
# A stage's dp reduction under way, from its first bucket to its ALLREDUCE's end: it overlaps the
# actor's instructions, so it is no share of the step's time (Note [overlapped dp reduction]).
DPREDUCE = "DP_REDUCE"
P2P = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B", FLUSHED})  # point to point: their waits are measured
COMM = P2P | {"ALLREDUCE", "TIE_REDUCE", ALLGATHER}


class Slice(NamedTuple):
    """One executed instruction on the controller's clock (ns)."""

    actor: int
    step: int  # index among the profiled steps
    index: int  # position in the actor's program (< 0: OPTIMIZER_STEP, ALL_GATHER, FEED, FLUSH, a DP_REDUCE entry)
    name: str  # e.g. "1F3", "0SEND_F2"
    kind: str  # e.g. "F", "SEND_F"
    start_ns: int
    end_ns: int
    wait_ns: int = 0  # of that, blocked in the transport's wait (Note [where a step goes] in split.py)

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) * 1e-9
