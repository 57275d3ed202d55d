"""A compiled program: one rank's lowered actions with buffer ids and peers fixed.

Encoded with msgpack as rows ``[kind, stage, microbatch, buf, peer, aux, fill_slot, tie_group]``:
``buf`` is the rank-local slot of (stage, microbatch); ``peer`` the pipeline rank at
the other end of a send/recv (-1 otherwise); ``aux`` the slot of the neighbouring
stage on the *same* rank that receives this action's result directly (a forward
output handed to stage s+1, or an input gradient handed to stage s-1), else -1;
``fill_slot`` a ``FILL``'s fill slot and ``tie_group`` a ``TIE_REDUCE``'s tie group, else -1
(their own fields, as on ``Action``: Note [one field per meaning] in schedules/actions.py).
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from schedules import Action, Kind

__all__ = ["Instr", "encode_program", "decode_program"]


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

    @property
    def action(self) -> Action:
        return Action(self.stage, self.kind, _given(self.microbatch), _given(self.fill_slot), _given(self.tie_group))

    def __repr__(self) -> str:
        return repr(self.action)


def encode_program(instrs: list[Instr]) -> bytes:
    return msgpack.packb([[i.kind.value, *i[1:]] for i in instrs])


def decode_program(data: bytes) -> list[Instr]:
    return [Instr(Kind(kind), *rest) for kind, *rest in msgpack.unpackb(data)]
