"""What moves between an actor's stages and its peers' in a program: the shapes each
channel learned (Note [shape learning]) and the receives posted early (Note [receive
prefetch]).  ``Transfers`` is held by ``actors.worker.StageWorker`` and run by its
``Interpreter`` (actors/interpreter.py), which tells it the step running (``use``)."""

from __future__ import annotations

import math
from typing import Callable

import torch

from schedules import PREFETCH, Kind, prefetch_ready

from .comm import Communicator
from .place import ActorPlace
from .program import Instr
from .stage_exec import detach_for_next
from .step_state import StepState
from .values import decode_header, describe_metas, encode_header, flatten, meta_of, unflatten

__all__ = ["Transfers"]


# Note [shape learning]: a receive must know the shapes and dtypes it receives.  In a step
# the controller marks ``relearn`` (the first step of a program, a new input signature,
# dynamic_shapes=True), each forward send is preceded by a header announcing its
# structure and shapes, and both ends remember it per (program, stage); a gradient's shapes
# are its forward output's, known on the receiving side without a header.  In the other
# steps nothing but the tensors travels, so a stage whose output changes shape without its
# input changing is an error here, not a hang at the receiver.
class Transfers:
    """One actor's sends and receives over ``comm``, program by program."""

    PREFETCH = PREFETCH

    def __init__(self, comm: Communicator, place: ActorPlace) -> None:
        self.comm, self.place = comm, place
        self.step = StepState()  # the step whose sends and receives run (``use``)
        # (program, stage) -> (spec, metas) of the stage's received input; per program because
        # the controller decides per program when shapes must be re-learned.
        self._recv_meta: dict[tuple[str, int], tuple] = {}
        self._sent_meta: dict[tuple[str, int], tuple] = {}  # the same, as the sending stage announced it
        # Note [receive prefetch]: once shapes are known, the next PREFETCH receives of the
        # program are posted early (irecv) so transfers overlap compute.  They are posted in
        # program order, so each channel still pairs its k-th send with its k-th receive; on
        # NCCL only after the earlier sends to their peer (Note [NCCL order] in schedules/posting.py).
        self._grad_meta: dict[tuple[str, int], list] = {}  # (program, stage) -> its output-gradient metas
        self._programs: dict[str, list[Instr]] = {}
        self._recv_at: dict[str, list[int]] = {}  # program -> positions of its receives
        self._kinds_peers: dict[str, tuple[list, list]] = {}  # program -> its instructions' kinds and peers
        self._peers: dict[str, list[int]] = {}  # program -> per position, the actor at the other end (or -1)

    def add_program(self, name: str, program: list[Instr]) -> None:
        place = self.place
        self._programs[name] = program
        self._recv_at[name] = [i for i, ins in enumerate(program) if ins.kind in (Kind.RECV_F, Kind.RECV_B)]
        self._kinds_peers[name] = ([i.kind for i in program], [i.peer for i in program])
        # Note [decoded programs] in actors/interpreter.py: each pipeline rank's actor in this replica and TP rank
        self._peers[name] = [place.grid.actor(place.replica, i.peer, place.tp_rank, place.cp_rank) if i.peer >= 0 else -1
                             for i in program]

    def peers_of(self, name: str) -> list[int]:
        """Per position of program ``name``, the actor at the other end (or -1)."""
        return self._peers[name]

    def use(self, step: StepState) -> None:
        """From now on, send and receive for ``step``."""
        self.step = step

    def send_forward(self, ins: Instr) -> None:
        cur = self.step
        spec, tensors = flatten(cur.slots[ins.buf].out)
        sent, key = (spec, meta_of(tensors)), (cur.program, ins.stage)
        if cur.relearn:
            self.comm.send_header(encode_header(*sent), cur.peers[cur.pc])
            self._sent_meta[key] = sent
        elif sent != (before := self._sent_meta.get(key, (None, []))):
            # The receiver expects the announced shapes; a different message would break its receive.
            raise RuntimeError(f"stage {ins.stage}'s output changed from {describe_metas(before[1])} "
                               f"to {describe_metas(sent[1])} while the step's input shapes did not; pass "
                               "Pipeline(..., dynamic_shapes=True) for stages whose output shape depends on the "
                               "values of their input")
        self.comm.send(tensors, cur.peers[cur.pc])
        self.prefetch(cur.pc + 1)

    def send_backward(self, ins: Instr) -> None:
        cur = self.step
        self.comm.send(cur.slots[ins.buf].grad_in, cur.peers[cur.pc])
        self.prefetch(cur.pc + 1)

    def recv_forward(self, ins: Instr) -> None:
        cur = self.step
        src = cur.peers[cur.pc]
        key = (cur.program, ins.stage)
        if cur.relearn or key not in self._recv_meta:
            if not cur.relearn:
                raise RuntimeError(f"stage {ins.stage} has no known input shape; the controller must relearn shapes")
            self._recv_meta[key] = decode_header(self.comm.recv_header(src))
        spec, metas = self._recv_meta[key]
        tensors = self._receive(metas)
        slot = cur.slot(ins.buf)
        slot.inp, slot.inp_grad = detach_for_next(unflatten(spec, tensors), cur.train)

    def recv_backward(self, ins: Instr) -> None:
        cur = self.step
        slot = cur.slots[ins.buf]
        metas = meta_of(slot.out_float)
        self._grad_meta[(cur.program, ins.stage)] = metas
        slot.grad_out = self._receive(metas)

    def _receive(self, metas: list) -> list:
        """The data of the receive running: from its prefetched irecv, or received now."""
        cur = self.step
        pos = self._recv_at[cur.program][cur.next_recv]
        cur.next_recv += 1
        handle = cur.posted.pop(pos, None)
        src = cur.peers[pos]
        tensors = self.comm.wait_recv(handle, src) if handle else self.comm.recv(metas, src)
        self.prefetch(cur.pc + 1)
        return tensors

    def prefetch(self, cursor: int = 0) -> None:
        """Post the next receives whose shapes are known; see Note [receive prefetch].
        ``cursor``: the first position whose sends are not posted yet."""
        cur = self.step
        if cur.relearn:
            return  # shapes travel in headers this step
        if len(cur.posted) >= self.PREFETCH:
            return  # the next PREFETCH receives are all posted (posted ones are always among them)
        prog, at = self._programs[cur.program], self._recv_at[cur.program]
        kinds, peers = self._kinds_peers[cur.program]
        for pos in prefetch_ready(kinds, peers, at, cur.next_recv, cursor, cur.posted, self.PREFETCH,
                                  self.comm.ordered):
            ins = prog[pos]
            if ins.kind is Kind.RECV_F:
                known = self._recv_meta.get((cur.program, ins.stage))
                metas = known[1] if known else None
            else:
                metas = self._grad_meta.get((cur.program, ins.stage))
            if metas is None:
                return  # later receives must not overtake this one on its channel
            cur.posted[pos] = self.comm.irecv(metas, cur.peers[pos])

    def arrival(self, pos: int) -> Callable[[], bool]:
        """Whether the receive at ``pos`` has arrived, where the backend can tell (a fill
        slot runs until then); always False for one not posted."""
        handle = self.step.posted.get(pos)
        return (lambda: self.comm.arrived(handle)) if handle is not None else (lambda: False)

    def sent_bytes(self, program: str) -> dict[int, int]:
        """Bytes of each local stage's output as program ``program`` last sent it (stage ->
        bytes; its gradient coming back is as large): the calibrated transfers' sizes."""
        return {stage: sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in metas)
                for (prog, stage), (_, metas) in self._sent_meta.items() if prog == program}
