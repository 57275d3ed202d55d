"""What moves between a ``StageWorker``'s stages and its peers' in a program: the
shapes each channel learned (Note [shape learning]), the receives posted early (Note
[receive prefetch]), and the fill slots that run until a receive arrives.  Mixed into ``actors.worker.StageWorker``, which owns ``self.comm``,
``self.current`` (the ``StepState`` running), ``self.grid`` and ``self.programs``."""

from __future__ import annotations

from typing import Any, Optional

from schedules import PREFETCH, Kind, prefetch_ready

from .program import Instr, decode_program
from .protocol import FillSlot
from .stage_exec import detach_for_next
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
    comm: Any  # actors.comm.Communicator
    current: Any  # actors.step_state.StepState
    grid: Any  # actors.grid.DeviceGrid
    programs: dict
    fill: Any  # actors.fill.FillRunner
    device: Any
    replica: int
    tp_rank: int

    def _init_transfers(self) -> None:
        # (program, stage) -> (spec, metas) of the stage's received input; per program because
        # the controller decides per program when shapes must be re-learned.
        self._recv_meta: dict[tuple[str, int], tuple] = {}
        self._sent_meta: dict[tuple[str, int], tuple] = {}  # the same, as the sending stage announced it
        # Note [receive prefetch]: once shapes are known, the next PREFETCH receives of the
        # program are posted early (irecv) so transfers overlap compute.  They are posted in
        # program order, so each channel still pairs its k-th send with its k-th receive; on
        # NCCL only after the earlier sends to their peer (Note [NCCL order] in schedules/posting.py).
        self._grad_meta: dict[tuple[str, int], list] = {}  # (program, stage) -> its output-gradient metas
        self._recv_at: dict[str, list[int]] = {}  # program -> positions of its receives
        self._kinds_peers: dict[str, tuple[list, list]] = {}  # program -> its instructions' kinds and peers
        self._split_backwards: dict[str, frozenset] = {}  # program -> (stage, microbatch)s it splits in I, W
        self._peers: dict[str, list[int]] = {}  # program -> per position, the actor at the other end (or -1)

    def set_program(self, name: str, data: bytes) -> int:
        self.programs[name] = program = decode_program(data)
        self._recv_at[name] = [i for i, ins in enumerate(program) if ins.kind in (Kind.RECV_F, Kind.RECV_B)]
        self._kinds_peers[name] = ([i.kind for i in program], [i.peer for i in program])
        self._split_backwards[name] = frozenset((i.stage, i.microbatch) for i in program if i.kind is Kind.I)
        # Note [decoded programs] in actors/worker.py: each pipeline rank's actor in this replica and TP rank
        self._peers[name] = [self.grid.actor(self.replica, i.peer, self.tp_rank) if i.peer >= 0 else -1
                             for i in program]
        return len(program)

    def _send_forward(self, ins: Instr) -> None:
        cur = self.current
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
        self._prefetch(cur.pc + 1)

    def _send_backward(self, ins: Instr) -> None:
        cur = self.current
        self.comm.send(cur.slots[ins.buf].grad_in, cur.peers[cur.pc])
        self._prefetch(cur.pc + 1)

    def _recv_forward(self, ins: Instr) -> None:
        cur = self.current
        src = cur.peers[cur.pc]
        key = (cur.program, ins.stage)
        if cur.relearn or key not in self._recv_meta:
            if not cur.relearn:
                raise RuntimeError(f"stage {ins.stage} has no known input shape; the controller must relearn shapes")
            self._recv_meta[key] = decode_header(self.comm.recv_header(src))
        spec, metas = self._recv_meta[key]
        tensors = self._receive(metas)
        slot = self._slot(ins.buf)
        slot.inp, slot.inp_grad = detach_for_next(unflatten(spec, tensors), cur.train)

    def _recv_backward(self, ins: Instr) -> None:
        cur = self.current
        slot = cur.slots[ins.buf]
        metas = meta_of(slot.out_float)
        self._grad_meta[(cur.program, ins.stage)] = metas
        slot.grad_out = self._receive(metas)

    PREFETCH = PREFETCH

    def _receive(self, metas: list) -> list:
        """The data of the receive running: from its prefetched irecv, or received now."""
        cur = self.current
        pos = self._recv_at[cur.program][cur.next_recv]
        cur.next_recv += 1
        handle = cur.posted.pop(pos, None)
        src = cur.peers[pos]
        tensors = self.comm.wait_recv(handle, src) if handle else self.comm.recv(metas, src)
        self._prefetch(cur.pc + 1)
        return tensors

    def _prefetch(self, cursor: int = 0) -> None:
        """Post the next receives whose shapes are known; see Note [receive prefetch].
        ``cursor``: the first position whose sends are not posted yet."""
        cur = self.current
        if cur.relearn:
            return  # shapes travel in headers this step
        if len(cur.posted) >= self.PREFETCH:
            return  # the next PREFETCH receives are all posted (posted ones are always among them)
        prog, at = self.programs[cur.program], self._recv_at[cur.program]
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

    def _run_fills(self, ins: Instr) -> None:
        """A fill slot: its chunks run while there is room (``FillRunner.run_slot``) and
        before the receive the slot precedes has arrived (where the backend can tell)."""
        cur = self.current
        slot: Optional[FillSlot] = cur.fills.get(ins.fill_slot)
        if slot:
            handle = cur.posted.get(cur.pc + 1)
            arrived = (lambda: self.comm.arrived(handle)) if handle is not None else (lambda: False)
            cur.fill_results += self.fill.run_slot(slot, self.device, arrived)
