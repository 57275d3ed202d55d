"""A compiled program: one rank's lowered actions with buffer ids and peers fixed.

Encoded with msgpack as rows ``[kind, stage, microbatch, buf, peer, aux]``:
``buf`` is the rank-local slot of (stage, microbatch); ``peer`` the pipeline rank at
the other end of a send/recv (-1 otherwise); ``aux`` the slot of the neighbouring
stage on the *same* rank that receives this action's result directly (a forward
output handed to stage s+1, or an input gradient handed to stage s-1), else -1.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from schedules import Action, Kind

__all__ = ["Instr", "encode_program", "decode_program"]


class Instr(NamedTuple):
    kind: Kind
    stage: int
    microbatch: int  # -1 for per-stage actions (ALLREDUCE)
    buf: int = -1
    peer: int = -1
    aux: int = -1

    @property
    def action(self) -> Action:
        return Action(self.stage, self.kind, None if self.microbatch < 0 else self.microbatch)

    def __repr__(self) -> str:
        return repr(self.action)


def encode_program(instrs: list[Instr]) -> bytes:
    return msgpack.packb([[i.kind.value, i.stage, i.microbatch, i.buf, i.peer, i.aux] for i in instrs])


def decode_program(data: bytes) -> list[Instr]:
    return [Instr(Kind(k), s, m, b, p, a) for k, s, m, b, p, a in msgpack.unpackb(data)]
