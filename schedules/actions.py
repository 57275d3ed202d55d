"""Instructions as values: an action is a stage, a kind and what it acts on, with a text form.

``repr(Action(1, Kind.F, 0)) == "1F0"`` and ``Action.parse("2SEND_B3")`` round-trips.
``ALLREDUCE`` is per stage and carries no microbatch: ``"1ALLREDUCE"``.  An ``OVERLAP`` is
a forward and a backward of one rank run together, written ``"1F3+0I2"`` (Note [overlapped
forward and backward]).  A ``FILL``
names a fill slot and a ``TIE_REDUCE`` a tie group instead: ``"0FILL3"`` is
``Action(0, Kind.FILL, fill_slot=3)``, ``"0TIE_REDUCE1"`` is ``Action(0, Kind.TIE_REDUCE, tie_group=1)``.
"""

from __future__ import annotations

import enum
import re
from typing import Iterable, Iterator, NamedTuple, Optional

__all__ = ["Kind", "Action", "COMPUTE_KINDS", "COMM_KINDS", "BACKWARD_KINDS", "WAIT_KINDS", "flat"]


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
    OVERLAP = "OVERLAP"  # a forward and a backward run together (``Action.parts``; text "1F3+0I2")

    def __str__(self) -> str:
        return self.value


# OVERLAP is compute too: code that reads what a compute does looks into ``Action.flat``.
COMPUTE_KINDS = frozenset({Kind.F, Kind.B, Kind.I, Kind.W, Kind.OVERLAP})
COMM_KINDS = frozenset({Kind.SEND_F, Kind.RECV_F, Kind.SEND_B, Kind.RECV_B})
# The kinds that produce the input gradient a previous stage waits for.
BACKWARD_KINDS = frozenset({Kind.B, Kind.I})
# Where a rank may wait on another (a bubble): receives and the all-reduces.
WAIT_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B, Kind.ALLREDUCE, Kind.TIE_REDUCE})
# The kinds that name no microbatch, and the field that names what they act on instead.
_INDEX_FIELD = {Kind.ALLREDUCE: None, Kind.OVERLAP: None, Kind.FILL: "fill_slot", Kind.TIE_REDUCE: "tie_group"}
# What an OVERLAP's parts may be: a forward, then a backward that makes an input gradient.
_PART_KINDS = ((Kind.F,), (Kind.B, Kind.I))

# Longest kinds first so "SEND_F" is not read as "S" + ...; kinds are all caps.
_KIND_ALT = "|".join(sorted((k.value for k in Kind if k is not Kind.OVERLAP), key=len, reverse=True))
_TEXT = re.compile(rf"^(\d+)({_KIND_ALT})(\d*)$")


class _ActionFields(NamedTuple):
    stage: int
    kind: Kind
    microbatch: Optional[int] = None
    fill_slot: Optional[int] = None
    tie_group: Optional[int] = None
    parts: Optional[tuple] = None  # OVERLAP: (forward, backward)


class Action(_ActionFields):
    """One instruction of a rank's program; see Note [one field per meaning].

    Fields: ``microbatch`` for the per-microbatch kinds (compute, send/recv, ``FREE``);
    ``fill_slot`` (which of the rank's PipeFill slots) for ``FILL`` alone; ``tie_group``
    (which tie group, a collective across ranks) for ``TIE_REDUCE`` alone; ``parts`` (a
    forward and a backward) for ``OVERLAP`` alone, whose ``stage`` is its forward's and
    whose ``microbatch`` is None (its parts name two); ``ALLREDUCE`` none.
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
    # is unchanged: ``0FILL3``, ``0TIE_REDUCE1``.  OVERLAP does hold sub-actions, so it is
    # the one composite (torch's ``OVERLAP_F_B`` with ``sub_actions``): its ``parts``.

    # Note [overlapped forward and backward]
    # --------------------------------------
    # ``Action(s, Kind.OVERLAP, parts=(F(s, i), B(t, j)))``, text ``"sFi+tBj"``: one rank
    # runs the forward of microbatch i and the backward (``B``, or ``I`` where the schedule
    # splits it; the ``W`` stays an action of its own) of microbatch j together, so each
    # expert all-to-all of one is in flight while the other computes (DualPipe; issue 59).
    # Both parts' inputs must be there when it starts (the lowering puts every receive
    # either part needs before it) and their outputs leave after it (every send after it):
    # so a part may not consume the other's output, and the simulators start both parts
    # at the composite's start and end both at its end.  Exactly one part computes at any
    # time on the actor, so the composite costs both computes plus the all-to-all time
    # neither hid (``Costs.of``).  Code that reads what a compute does (its kind, stage,
    # microbatch) reads ``Action.flat``: the parts of an OVERLAP, the action itself else.
    __slots__ = ()

    def __new__(cls, stage: int, kind: Kind, microbatch: Optional[int] = None, fill_slot: Optional[int] = None,
                tie_group: Optional[int] = None, parts: Optional[tuple] = None) -> "Action":
        wanted = _INDEX_FIELD.get(kind, "microbatch")
        for name, value in (("microbatch", microbatch), ("fill_slot", fill_slot), ("tie_group", tie_group)):
            if value is not None and name != wanted:
                fix = f", {wanted}={value}" if wanted else ""
                raise ValueError(f"Action({stage}, {kind}, {name}={value}): {kind} takes no {name}; write "
                                 f"Action({stage}, Kind.{Kind(kind).name}{fix}) (Note [one field per meaning])")
        if kind is Kind.OVERLAP:
            parts = _check_parts(stage, parts)
        elif parts is not None:
            raise ValueError(f"Action({stage}, {kind}, parts=...): only an OVERLAP has parts; write "
                             f"Action.overlap(forward, backward) (Note [overlapped forward and backward])")
        return super().__new__(cls, stage, kind, microbatch, fill_slot, tie_group, parts)

    @classmethod
    def overlap(cls, forward: "Action", backward: "Action") -> "Action":
        """The OVERLAP of ``forward`` (an ``F``) and ``backward`` (a ``B`` or ``I``) of one rank."""
        return cls(forward.stage, Kind.OVERLAP, parts=(forward, backward))

    @property
    def flat(self) -> tuple["Action", ...]:
        """What this action computes, one by one: an OVERLAP's parts, else the action itself."""
        return self.parts if self.parts is not None else (self,)

    @property
    def _index(self) -> Optional[int]:
        """The number the text form writes after the kind (microbatch, fill slot or tie group)."""
        field = _INDEX_FIELD.get(self.kind, "microbatch")
        return None if field is None else getattr(self, field)

    def __repr__(self) -> str:
        if self.parts is not None:
            return "+".join(map(repr, self.parts))
        index = self._index
        return f"{self.stage}{self.kind.value}{'' if index is None else index}"

    __str__ = __repr__

    @classmethod
    def parse(cls, text: str) -> "Action":
        """Parse the text form, e.g. ``"1F0"``, ``"0SEND_B3"``, ``"2ALLREDUCE"``, ``"0FILL3"``,
        ``"1F3+0I2"`` (an OVERLAP: forward + backward)."""
        if "+" in text:
            words = text.strip().split("+")
            if len(words) != 2:
                raise ValueError(f"cannot parse action {text!r}: an OVERLAP is two actions joined by '+', "
                                 f"a forward and a backward, e.g. '1F3+0I2'")
            return cls.overlap(*(cls.parse(w) for w in words))
        m = _TEXT.match(text.strip())
        if m is None:
            raise ValueError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> like "
                f"'1F0' or '2SEND_B3' with kind one of {', '.join(k.value for k in Kind if k is not Kind.OVERLAP)}, "
                f"or an OVERLAP like '1F3+0I2'"
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


def _check_parts(stage: int, parts) -> tuple:
    """``parts`` as a (forward, backward) tuple, or a ValueError saying what is wrong."""
    ok = isinstance(parts, tuple) and len(parts) == 2 and all(isinstance(p, Action) for p in parts)
    if not ok:
        raise ValueError(f"an OVERLAP needs parts=(forward, backward), two actions, got {parts!r}; "
                         f"write Action.overlap(Action(1, Kind.F, 3), Action(0, Kind.I, 2)) or '1F3+0I2'")
    text = "+".join(map(repr, parts))
    for part, kinds, what in zip(parts, _PART_KINDS, ("a forward (F)", "a backward (B or I)")):
        if part.kind not in kinds:
            hint = (" (a W stays an action of its own after the OVERLAP)" if part.kind is Kind.W
                    else " (write the forward first)" if part.kind in _PART_KINDS[1] or parts[1].kind is Kind.F else "")
            raise ValueError(f"OVERLAP {text}: {part!r} must be {what}{hint}")
    if stage != parts[0].stage:
        raise ValueError(f"OVERLAP {text}: its stage is its forward's, {parts[0].stage}, not {stage}")
    return parts


def flat(actions: Iterable[Action]) -> Iterator[Action]:
    """The actions with each OVERLAP replaced by its parts, forward first."""
    for a in actions:
        yield from a.flat
