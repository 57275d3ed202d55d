"""Instructions as values: an action is a stage, a kind and what it acts on, with a text form.

``repr(Action(1, Kind.F, 0)) == "1F0"`` and ``Action.parse("2SEND_B3")`` round-trips.
``ALLREDUCE`` is per stage and carries no microbatch: ``"1ALLREDUCE"``.  A ``FILL``
names a fill slot and a ``TIE_REDUCE`` a tie group instead: ``"0FILL3"`` is
``Action(0, Kind.FILL, fill_slot=3)``, ``"0TIE_REDUCE1"`` is ``Action(0, Kind.TIE_REDUCE, tie_group=1)``.
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
    FILL = "FILL"  # a slot for independent fill work in a bubble (``Action.fill_slot``)
    TIE_REDUCE = "TIE_REDUCE"  # sum the gradients of parameters stages share (``Action.tie_group``)

    def __str__(self) -> str:
        return self.value


COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# The kinds that produce the input gradient a previous stage waits for.
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})
# Where a rank may wait on another (a bubble): receives and the all-reduces.
WAIT_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.ALLREDUCE, Kind.TIE_REDUCE})
# The kinds that name no microbatch, and the field that names what they act on instead.
_INDEX_FIELD = {Kind.ALLREDUCE: None, Kind.FILL: "fill_slot", Kind.TIE_REDUCE: "tie_group"}

# Longest kinds first so "SEND_F" is not read as "S" + ...; kinds are all caps.
_KIND_ALT = "|".join(sorted((k.value for k in Kind), key=len, reverse=True))
_TEXT = re.compile(rf"^(\d+)({_KIND_ALT})(\d*)$")


class _ActionFields(NamedTuple):
    stage: int
    kind: Kind
    microbatch: Optional[int] = None
    fill_slot: Optional[int] = None
    tie_group: Optional[int] = None


class Action(_ActionFields):
    """One instruction of a rank's program; see Note [one field per meaning].

    Fields: ``microbatch`` for the per-microbatch kinds (compute, send/recv, ``FREE``);
    ``fill_slot`` (which of the rank's PipeFill slots) for ``FILL`` alone; ``tie_group``
    (which tie group, a collective across ranks) for ``TIE_REDUCE`` alone; ``ALLREDUCE`` none.
    """

    # Note [one field per meaning]
    # ----------------------------
    # A fill slot and a tie group once rode in ``microbatch``, so generic code that keys
    # buffers, ranges or transfers on (stage, microbatch) had to remember to skip those
    # kinds (``from_lists`` did not: a fill slot counted as a microbatch).  FILL and
    # TIE_REDUCE were already kinds of their own (torch's ``_Action`` gives REDUCE_GRAD
    # one too); what was shared was the index, so each index gets its own field and
    # ``microbatch`` is None for them.  Fields rather than composite actions: neither
    # holds sub-actions, and a named field makes each reader say which index it means.
    # ``fill_slot`` and ``tie_group``, not ``slot`` and ``group``: on the actor a slot is
    # a buffer (``Instr.buf``) and a group a communicator (``TieGroup.group``).
    # The constructor refuses a field the kind does not take, so ``Action(0, Kind.FILL, 3)``
    # (the old spelling) fails at once instead of running an empty slot.  The text form
    # is unchanged: ``0FILL3``, ``0TIE_REDUCE1``.
    __slots__ = ()

    def __new__(cls, stage: int, kind: Kind, microbatch: Optional[int] = None, fill_slot: Optional[int] = None,
                tie_group: Optional[int] = None) -> "Action":
        wanted = _INDEX_FIELD.get(kind, "microbatch")
        for name, value in (("microbatch", microbatch), ("fill_slot", fill_slot), ("tie_group", tie_group)):
            if value is not None and name != wanted:
                fix = f", {wanted}={value}" if wanted else ""
                raise ValueError(f"Action({stage}, {kind}, {name}={value}): {kind} takes no {name}; write "
                                 f"Action({stage}, Kind.{Kind(kind).name}{fix}) (Note [one field per meaning])")
        return super().__new__(cls, stage, kind, microbatch, fill_slot, tie_group)

    @property
    def _index(self) -> Optional[int]:
        """The number the text form writes after the kind (microbatch, fill slot or tie group)."""
        field = _INDEX_FIELD.get(self.kind, "microbatch")
        return None if field is None else getattr(self, field)

    def __repr__(self) -> str:
        index = self._index
        return f"{self.stage}{self.kind.value}{'' if index is None else index}"

    __str__ = __repr__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the text form, e.g. ``"1F0"``, ``"0SEND_B3"``, ``"2ALLREDUCE"``, ``"0FILL3"``."""
        m = _TEXT.match(text.strip())
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> like "
                f"'1F0' or '2SEND_B3' with kind one of {', '.join(k.value for k in Kind)}"
            )
        stage, kind, mb = int(m.group(1)), Kind(m.group(2)), m.group(3)
        field = _INDEX_FIELD.get(kind, "microbatch")
        if field is None:
            if mb:
                raise ValueError(f"cannot parse action {text!r}: ALLREDUCE takes no microbatch, write '{stage}ALLREDUCE'")
            return cls(stage, kind)
        if not mb:
            what = {"microbatch": "a microbatch index", "fill_slot": "a fill slot index", "tie_group": "a tie group index"}[field]
            raise ValueError(f"cannot parse action {text!r}: {kind.value} needs {what}, e.g. '{stage}{kind.value}0'")
        return cls(stage, kind, **{field: int(mb)})
