"""A compiled program: one rank's lowered actions with buffer ids and peers fixed.

Encoded with msgpack as rows ``[kind, stage, microbatch, buf, peer, aux, fill_slot, tie_group, parts]``:
``buf`` is the rank-local slot of (stage, microbatch); ``peer`` the pipeline rank at
the other end of a send/recv (-1 otherwise); ``aux`` the slot of the neighbouring
stage on the *same* rank that receives this action's result directly (a forward
output handed to stage s+1, or an input gradient handed to stage s-1), else -1;
``fill_slot`` a ``FILL``'s fill slot and ``tie_group`` a ``TIE_REDUCE``'s tie group, else -1
(their own fields, as on ``Action``: Note [one field per meaning] in schedules/actions.py);
``parts`` an ``OVERLAP``'s two sub-instructions (its forward's and its backward's rows, each
with its own ``buf`` and ``aux``, as the forward and the backward would have alone; the
composite's own ``buf``, ``peer``, ``aux`` are -1), else empty (Note [overlapped forward and
backward] in schedules/actions.py).
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from schedules import Action, Kind

__all__ = ["Instr", "encode_program", "decode_program", "flat_program"]


def _given(index: int):
    return None if index < 0 else index


class Instr(NamedTuple):
    kind: Kind
    stage: int
    microbatch: int  # -1 for actions that name no microbatch (ALLREDUCE, FILL, TIE_REDUCE)
    buf: int = -1
    peer: int = -1
    aux: int = -1
    fill_slot: int = -1  # FILL: which of this step's fill slots (``StepState.fills``)
    tie_group: int = -1  # TIE_REDUCE: which tie group (``TieGroup.index``)
    parts: tuple = ()  # OVERLAP: (forward's Instr, backward's Instr)

    @property
    def action(self) -> Action:
        if self.parts:
            return Action.overlap(*(p.action for p in self.parts))
        return Action(self.stage, self.kind, _given(self.microbatch), _given(self.fill_slot), _given(self.tie_group))

    @property
    def flat(self) -> tuple["Instr", ...]:
        """What this instruction computes, one by one: an OVERLAP's parts, else itself."""
        return self.parts or (self,)

    def __repr__(self) -> str:
        return repr(self.action)


def encode_program(instrs: list[Instr]) -> bytes:
    return msgpack.packb([_row(i) for i in instrs])


def decode_program(data: bytes) -> list[Instr]:
    return [_instr(row) for row in msgpack.unpackb(data)]


def flat_program(instrs: list[Instr]):
    """``(position, instruction)`` of each single instruction, an OVERLAP's parts at its position."""
    return ((n, part) for n, i in enumerate(instrs) for part in i.flat)


def _row(i: Instr) -> list:
    return [i.kind.value, *i[1:-1], [_row(p) for p in i.parts]]


def _instr(row: list) -> Instr:
    kind, *rest, parts = row
    return Instr(Kind(kind), *rest, tuple(_instr(p) for p in parts))
