"""``Interpreter``: runs an actor's compiled programs, instruction by instruction.

``run_call(StepCall, ...)`` runs a program for one step, or a slice of it (``fusion=
"consecutive"`` / ``"none"``), and the step's last call answers with a ``StepReply``
(``actors/protocol.py``).  What lives for one step is one ``StepState``; sends and receives
are the ``Transfers``' (actors/transfers.py), the stages and their optimizers the ``Stages``'
(actors/stages.py), which ``use_stages`` swaps in at each ``setup``."""

from __future__ import annotations

import functools
import time
from typing import Optional

import torch
from torch.distributed.tensor.parallel import loss_parallel

from schedules import Kind

from .comm import Communicator
from .cp_runtime import StepShards, sharded
from .dp_reduce import average_experts, last_backwards
from .errors import StageError, instruction_error
from .experts import EXCHANGES
from .fill import FillRunner
from .overlap import Overlapper
from .place import ActorPlace
from .program import Instr, decode_program, flat_program
from .protocol import ALL_GATHER, FEED, FLUSH, OPTIMIZER_STEP, StepCall, StepReply, dp_reduce_entry
from .stage_exec import backward_full, backward_input, backward_weight, detach_for_next, forward
from .stages import Stages
from .step_inputs import StepInputs, step_inputs
from .step_state import StepState
from .tensor_parallel import whole as gathered
from .timing import DeviceTimer
from .transfers import Transfers
from .update import Update, update
from .values import to_device
from .zero import average_gradients, gather_from_owners

__all__ = ["Interpreter"]

_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)  # what runs the last stage's loss or its backward


class Interpreter:
    """The program runner of one actor, over ``comm``, with ``transfers`` for its sends and
    receives and ``fill`` for its PipeFill slots."""

    def __init__(self, place: ActorPlace, comm: Communicator, timer: DeviceTimer, transfers: Transfers,
                 fill: FillRunner) -> None:
        self.place, self.comm, self.timer, self.transfers, self.fill = place, comm, timer, transfers, fill
        self.prep = StepInputs.for_device(place.device)  # Note [step inputs] in actors/step_inputs.py
        self.stages = Stages()  # ``use_stages`` gives the ones ``setup`` built
        self.programs: dict[str, list[Instr]] = {}
        self._arm_at: dict[str, dict[int, int]] = {}  # program -> {position of a stage's last backward: stage}
        self._split_backwards: dict[str, frozenset] = {}  # program -> (stage, microbatch)s it splits in I, W
        self.current = StepState()  # the step running, or the last one
        self.feed = None  # actors/feed.py: where fed steps get their batch
        self._mode: Optional[bool] = None  # the modules' train mode, set when a step needs the other one
        self.overlapper = Overlapper()  # runs OVERLAP instructions (Note [overlap turns] in actors/overlap.py)
        # Note [decoded programs]: what runs each kind of instruction (bound once).
        self._handlers = {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._backward_input,
                          Kind.W: self._backward_weight, Kind.SEND_F: transfers.send_forward,
                          Kind.RECV_F: transfers.recv_forward, Kind.SEND_B: transfers.send_backward,
                          Kind.RECV_B: transfers.recv_backward, Kind.ALLREDUCE: self._average,
                          Kind.FILL: self._run_fills, Kind.TIE_REDUCE: self._tie_reduce, Kind.FREE: self._free,
                          Kind.OVERLAP: self._overlap}
        self._run_at: dict[str, list] = {}  # program -> per position, what runs its instruction

    # -- set-up --------------------------------------------------------------------------------
    def use_stages(self, stages: Stages) -> None:
        """Run the steps from now on with ``stages`` (just built: in train mode)."""
        self.stages = stages
        self._mode = True

    # Note [decoded programs]: ``set_program`` resolves, per position, the bound method that runs
    # the instruction (and ``Transfers`` each send's and receive's peer), so the interpreter
    # indexes a list instead of testing the kind against each branch and asking the grid for
    # the peer, every instruction.
    def set_program(self, name: str, data: bytes) -> int:
        self.programs[name] = program = decode_program(data)
        self.transfers.add_program(name, program)
        self._split_backwards[name] = frozenset((i.stage, i.microbatch) for _, i in flat_program(program)
                                                if i.kind is Kind.I)
        self._arm_at[name] = last_backwards(program)  # Note [overlapped dp reduction]
        self._run_at[name] = [functools.partial(self._compute, self._handlers[ins.kind]) if ins.kind in _COMPUTE
                              else self._handlers[ins.kind] for ins in program]  # Note [decoded programs]
        return len(program)

    def close(self) -> None:
        """What this interpreter left running: the feed, the overlaps' second thread."""
        self.attach_feed(None)
        self.overlapper.close()

    def attach_feed(self, feed) -> None:
        """From now on, training steps given no data pull it through ``feed`` (a ``Feed`` or a
        ``TargetsFrom``, Note [fed steps] in actors/feed.py); None stops that."""
        if self.feed is not None:
            self.feed.close()
        self.feed = feed
        if feed is not None:
            feed.start()

    # -- one step ----------------------------------------------------------------------------
    def run_call(self, call: tuple, inputs=None, targets=None, fills: Optional[dict] = None,
                 side: Optional[tuple] = None) -> Optional[tuple]:
        """Run instructions ``[call.start, call.end)`` of program ``call.program`` for ``call.step``
        (``StageWorker.run_call`` says what the arguments are)."""
        # the step's window starts here, on the wall clock and this thread's CPU clock (Note [where a
        # step goes] in mpmd/profiler/split.py)
        entered, cpu = time.time_ns(), time.thread_time_ns()
        call = StepCall._make(call)
        if call.start == 0:
            self._begin(call, inputs, targets, fills, side)
            self.current.entered_ns = entered
        cur = self.current
        prog, run = self.programs[cur.program], self._run_at[cur.program]  # Note [decoded programs]
        for i in range(call.start, len(prog) if call.end < 0 else call.end):
            ins = prog[i]
            cur.pc = i
            if cur.profile:  # Note [device timing] in actors/timing.py
                t0, blocked, c0 = self.timer.mark(), self.comm.blocked_ns, time.thread_time_ns()
            try:
                run[i](ins)
            except Exception as e:  # noqa: BLE001 - re-raised with where it happened
                raise self._error(i, ins, e) from None
            if cur.profile:
                cur.timeline.append((i, t0, self.timer.mark()))
                if ins.kind is not Kind.FREE:  # a FREE is the actor's own bookkeeping
                    cur.slices_cpu_ns += time.thread_time_ns() - c0
                if self.comm.blocked_ns != blocked:
                    cur.waited.append((i, self.comm.blocked_ns - blocked))
                if EXCHANGES.spans:
                    cur.exchanges.extend((i, *span) for span in EXCHANGES.take_flights())
        if call.last:
            return tuple(self._finish(cpu))
        if cur.profile:
            cur.cpu_ns += time.thread_time_ns() - cpu
        return None

    def _begin(self, call: StepCall, inputs, targets, fills: Optional[dict], side: Optional[tuple]) -> None:
        if call.program not in self.programs:
            raise RuntimeError(f"no program named {call.program!r} was shipped to rank {self.place.rank}")
        train = call.program == "train"
        self.comm.first_step = call.relearn  # more patience while pairs connect (Note [stuck operations])
        fed = train and self.feed is not None and inputs is None and targets is None  # Note [fed steps]
        if call.profile:
            self.timer.begin()  # before the step pulls or posts anything (Note [device sync])
        t0, c0 = (self.timer.mark(), time.thread_time_ns()) if call.profile and fed else (0, 0)
        inputs, targets, per_mb, whole = step_inputs(  # pinned, uploaded once: Note [step inputs]
            self.prep, inputs, targets, side, (lambda keep: self.feed.pull(self.comm, keep, call.step)) if fed else None)
        shards = None
        if self.place.grid.cp > 1 or self.stages.document_mask:  # Note [context-parallel runtime]
            shards = StepShards(self.comm.cp_group, self.place.grid.cp, self.place.cp_rank, self.stages.document_mask)
            inputs, targets, per_mb = shards.cut(inputs, targets, per_mb)
        self.current = StepState(program=call.program, step=call.step, relearn=call.relearn, profile=call.profile,
                                 train=train, collect=call.collect, inputs=inputs, targets=targets,
                                 fills=fills or {}, side=per_mb, side_whole=whole,
                                 peers=self.transfers.peers_of(call.program), shards=shards)
        self.transfers.use(self.current)
        EXCHANGES.recording = call.profile  # expert all-to-alls go into a profiled step's timeline
        EXCHANGES.take()
        if call.profile and fed:  # the batch's cost on this actor: read, received or sent on
            self.current.timeline.append((FEED, t0, self.timer.mark()))
            self.current.slices_cpu_ns += time.thread_time_ns() - c0
        torch.set_grad_enabled(train)
        if train is not self._mode:  # only here and in use_stages; walking every module took ~0.1 ms a step
            for m in self.stages.modules.values():
                m.train(train)
            self._mode = train
        self.stages.disarm()  # a failed step may have left a reduction armed
        self.transfers.prefetch()

    def _finish(self, cpu: int) -> StepReply:
        """End the step; ``cpu``: this thread's CPU clock when the call ending it began."""
        cur, st = self.current, self.stages
        if cur.profile:
            t0, blocked, c0 = self.timer.mark(), self.comm.blocked_ns, time.thread_time_ns()
            self.comm.flush()
            cur.timeline.append((FLUSH, t0, self.timer.mark()))
            cur.waited.append((FLUSH, self.comm.blocked_ns - blocked))
            cur.slices_cpu_ns += time.thread_time_ns() - c0
        else:
            self.comm.flush()
        done, moe = Update(skipped=False, grad_norm=None, lr=None), None
        if cur.train:  # Note [agreed update] in actors/update.py: every actor decides alike
            t0, c0 = (self.timer.mark(), time.thread_time_ns()) if cur.profile else (0, 0)
            finite = bool(torch.isfinite(torch.stack(cur.losses)).all()) if cur.losses else True
            done = update(st.optimizers, st.schedulers, st.counted, self.comm, st.recipe, finite,
                          1 if st.zero else st.dp, st.loss_scale, self._gather if st.zero else None,
                          experts=st.experts.counted(st.counted) if st.experts is not None else ((), 1.0))
            if st.experts is not None:  # the routers' bias step and the loads, every replica alike
                moe = st.experts.finish_step(st.modules, self.comm.dp_sum,
                                             report=not self.place.replica and not self.place.tp_rank,
                                             skipped=done.skipped)
            for p in (p for zs in st.zero.values() for p in zs.params):  # a tie's copies owned elsewhere
                p.grad = None
            if cur.profile:  # the optimizer step ends where ZeRO-1's all-gather begins
                cur.timeline.append((OPTIMIZER_STEP, t0, self.timer.mark() if cur.gathered is None else cur.gathered))
                cur.slices_cpu_ns += time.thread_time_ns() - c0  # the all-gather's too
        torch.set_grad_enabled(True)
        first = not self.place.tp_rank  # TP ranks compute the same loss and outputs: one reports them
        timeline = self.timer.resolve(cur.timeline) if cur.profile else cur.timeline
        reply = StepReply(losses=torch.stack(cur.losses).tolist() if cur.losses and first else [], timeline=timeline,
                          window=(cur.entered_ns, time.time_ns(), cur.cpu_ns + time.thread_time_ns() - cpu,
                                  cur.slices_cpu_ns) if cur.profile else (), waited=tuple(cur.waited),
                          exchanges=tuple(cur.exchanges),
                          skipped=done.skipped, grad_norm=done.grad_norm, lr=done.lr,
                          outputs=[cur.outputs[m] for m in sorted(cur.outputs)] if cur.outputs and first else None,
                          fills=tuple(cur.fill_results), moe=moe)
        # The step's buffers go now, not when the next step begins.
        self.current = StepState(program=cur.program, step=cur.step)
        self.transfers.use(self.current)
        return reply

    def _gather(self) -> None:  # ZeRO-1's all-gather (Note [ZeRO-1 sharding]), timed apart when profiling
        cur, st = self.current, self.stages
        cur.gathered = self.timer.mark() if cur.profile else None  # Note [device timing] in actors/timing.py
        for s in sorted(st.zero):
            gather_from_owners(self.comm, st.zero[s], st.bucket_bytes)
        if cur.profile:
            cur.timeline.append((ALL_GATHER, cur.gathered, self.timer.mark()))

    # -- instructions ------------------------------------------------------------------------
    def _compute(self, run, ins: Instr) -> None:
        shards = self.current.shards
        if shards is not None:  # the stage's attention reads the shard (Note [context-parallel runtime])
            with sharded(shards.context(ins.microbatch)):
                return self._compute_here(run, ins)
        return self._compute_here(run, ins)

    def _compute_here(self, run, ins: Instr) -> None:
        if self.stages.recipe.loss_parallel and ins.stage == self.stages.num_stages - 1:
            # the loss on vocabulary shards, forward and backward (Note [vocabulary-parallel loss] in
            # mpmd/tensor_parallel/builtin.py)
            with loss_parallel():
                run(ins)
        else:
            run(ins)

    def _overlap(self, ins: Instr) -> None:
        """An OVERLAP: its forward here, its backward in the overlapper's thread, taking turns at
        the expert exchanges (Note [overlap turns] in actors/overlap.py)."""
        fwd, bwd = ins.parts
        self.overlapper.run(functools.partial(self._compute, self._handlers[fwd.kind], fwd),
                            functools.partial(self._compute, self._handlers[bwd.kind], bwd))

    def _backward(self, ins: Instr) -> None:
        self._arm(self.current.pc)
        backward_full(self.current.slots[ins.buf])
        self._hand_back(ins)

    def _backward_input(self, ins: Instr) -> None:
        backward_input(self.stages.modules[ins.stage], self.current.slots[ins.buf])
        self._hand_back(ins)

    def _backward_weight(self, ins: Instr) -> None:
        self._arm(self.current.pc)
        backward_weight(self.stages.modules[ins.stage], self.current.slots[ins.buf])

    def _tie_reduce(self, ins: Instr) -> None:
        self.stages.tied[ins.tie_group].reduce(self.comm, self.stages.bucket_bytes)

    def _free(self, ins: Instr) -> None:
        self.current.slots.pop(ins.buf, None)

    def _run_fills(self, ins: Instr) -> None:
        """A fill slot: its chunks run while there is room (``FillRunner.run_slot``) and
        before the receive the slot precedes has arrived (where the backend can tell)."""
        cur = self.current
        slot = cur.fills.get(ins.fill_slot)
        if slot:
            cur.fill_results += self.fill.run_slot(slot, self.place.device, self.transfers.arrival(cur.pc + 1))

    def _arm(self, pc: int) -> None:
        """Before a backward: when it is its stage's last, the stage's buckets start as their
        gradients become final (Note [overlapped dp reduction])."""
        stage = self._arm_at[self.current.program].get(pc)
        reductions = self.stages.reductions
        if stage is not None and stage in reductions:
            reductions[stage].arm(self.timer.mark if self.current.profile else None)

    def _average(self, ins: Instr) -> None:
        """The replicas' mean of stage ``ins.stage``: all-reduced, or reduce-scattered under ZeRO-1."""
        stage, st = ins.stage, self.stages
        red = st.reductions.get(stage)
        experts = st.experts.params.get(stage) if st.experts is not None else None
        if red is None:
            average_gradients(self.comm, st.modules[stage], st.zero.get(stage), st.bucket_bytes,
                              st.experts.ids if st.experts is not None else frozenset())
        else:
            first = red.finish()
            cur = self.current
            if cur.profile and first is not None:  # from the first bucket's start to the wait's end
                cur.timeline.append((dp_reduce_entry(cur.pc), first, self.timer.mark()))
        if experts:  # Note [expert parallelism] in actors/grid.py
            average_experts(self.comm, experts, st.dp, st.bucket_bytes)

    def _forward(self, ins: Instr) -> None:
        cur, st = self.current, self.stages
        device = self.place.device
        slot = cur.slot(ins.buf)
        if ins.stage == 0:
            slot.inp = to_device(cur.inputs[ins.microbatch], device)
        elif slot.inp is None:
            raise RuntimeError("forward before its input arrived (no RECV_F or local hand-off)")
        last = ins.stage == st.num_stages - 1
        target = None
        if last and cur.targets is not None:
            target = to_device(cur.targets[ins.microbatch], device)
        loss_fn = st.loss_fn if last and not cur.collect else None
        scale = st.loss_scale.scale if st.loss_scale is not None and cur.train else 1.0
        weight = cur.shards.weight(ins.microbatch) if cur.shards is not None else 1.0  # Note [context-parallel runtime]
        forward(st.modules[ins.stage], slot, target, loss_fn, scale * weight / st.num_microbatches,
                cur.side_kwargs(st.side_takes.get(ins.stage, ()), ins.microbatch),
                cur.side_kwargs(st.loss_takes, ins.microbatch) if loss_fn is not None else None,
                autocast=st.autocast, boundary=not last, recompute=cur.train and ins.stage in st.recipe.recompute,
                split=(ins.stage, ins.microbatch) in self._split_backwards[cur.program])
        if slot.loss is not None:
            cur.losses.append(slot.loss.detach().float() * (st.num_microbatches / scale))  # weighted: the CP share
        if last and cur.collect:  # logits sharded over the vocabulary come back whole
            cur.outputs[ins.microbatch] = to_device(gathered(slot.out), torch.device("cpu"))
        if ins.aux >= 0:  # the next stage lives here too: hand the output over directly
            nxt = cur.slot(ins.aux)
            nxt.inp, nxt.inp_grad = detach_for_next(slot.out, cur.train)

    def _hand_back(self, ins: Instr) -> None:
        if ins.aux >= 0:  # the previous stage lives here too
            cur = self.current
            cur.slot(ins.aux).grad_out = cur.slots[ins.buf].grad_in

    def _error(self, index: int, ins: Instr, exc: BaseException) -> StageError:
        cur = self.current
        part = ins.parts[self.overlapper.failed] if ins.kind is Kind.OVERLAP and self.overlapper.failed is not None \
            else None  # the part of an OVERLAP that failed
        ins = part or ins
        slot = cur.slots.get(ins.buf)
        return instruction_error(exc, rank=self.place.rank, replica=self.place.replica, step=cur.step,
                                 program_name=cur.program, program=self.programs[cur.program], index=index,
                                 stage_input=slot.inp if ins.kind is Kind.F and slot is not None else None,
                                 nccl=self.comm.backend == "nccl", part=part)
