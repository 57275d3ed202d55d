"""Instructions as values: an action is (stage, kind, microbatch) with a text form.

``repr(Action(1, Kind.F, 0)) == "1F0"`` and ``Action.parse("2SEND_B3")`` round-trips.
``ALLREDUCE`` is per stage and carries no microbatch: ``"1ALLREDUCE"``.
"""

from __future__ import annotations

import enum
import re
from typing import NamedTuple, Optional

__all__ = ["Kind", "Action", "COMPUTE_KINDS", "COMM_KINDS", "BACKWARD_KINDS", "WAIT_KINDS"]


class Kind(str, enum.Enum):
    F = "F"  # forward
    B = "B"  # full backward (input and weight gradients)
    I = "I"  # noqa: E741  backward, input-gradient part
    W = "W"  # backward, weight-gradient part
    SEND_F = "SEND_F"  # send stage output (activation) to the next stage
    RECV_F = "RECV_F"  # receive stage input from the previous stage
    SEND_B = "SEND_B"  # send input gradient to the previous stage
    RECV_B = "RECV_B"  # receive output gradient from the next stage
    ALLREDUCE = "ALLREDUCE"  # data-parallel gradient all-reduce of a stage
    FREE = "FREE"  # drop every buffer held for (stage, microbatch)
    FILL = "FILL"  # a slot for independent fill work in a bubble (microbatch = slot index)
    TIE_REDUCE = "TIE_REDUCE"  # sum the gradients of parameters stages share (microbatch = tie group)

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# The kinds that produce the input gradient a previous stage waits for.
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})
# Where a rank may wait on another (a bubble): receives and the all-reduces.
WAIT_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.ALLREDUCE, Kind.TIE_REDUCE})

# Longest kinds first so "SEND_F" is not read as "S" + ...; kinds are all caps.
_KIND_ALT = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_TEXT = re.compile(rf"^(\d+)({_KIND_ALT})(\d*)$")


class Action(NamedTuple):
    stage: int
    kind: Kind
    microbatch: Optional[int] = None

    def __repr__(self) -> str:
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind.value}{mb}"

    __str__ = __repr__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the text form, e.g. ``"1F0"``, ``"0SEND_B3"``, ``"2ALLREDUCE"``."""
        m = _TEXT.match(text.strip())
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> like "
                f"'1F0' or '2SEND_B3' with kind one of {', '.join(k.value for k in Kind)}"
            )
        stage, kind, mb = int(m.group(1)), Kind(m.group(2)), m.group(3)
        if kind is Kind.ALLREDUCE:
            if mb:
                raise ValueError(f"cannot parse action {text!r}: ALLREDUCE takes no microbatch, write '{stage}ALLREDUCE'")
            return cls(stage, kind, None)
        if not mb:
            raise ValueError(f"cannot parse action {text!r}: {kind.value} needs a microbatch index, e.g. '{stage}{kind.value}0'")
        return cls(stage, kind, int(mb))
