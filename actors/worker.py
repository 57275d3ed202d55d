"""``StageWorker``: what one pipeline rank runs inside its Ray actor.

It owns the rank's stage modules, one optimizer per stage and the communicator. ``run_call(StepCall, ...)`` runs a
compiled program for one step, or a slice of it (``fusion="consecutive"`` / ``"none"``), and answers the step's last
call with a ``StepReply`` (``actors/protocol.py``). What lives for one step is one ``StepState``. Sends and receives
are in ``actors/transfers.py``; state for checkpoints and the profiler's probes in ``actors/state.py``.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Optional

import torch
from torch.distributed.tensor.parallel import loss_parallel

from schedules import Kind

from .build import load_stage
from .channel import ChannelServer
from .comm import Communicator, node_ip
from .dp_reduce import last_backwards, stage_reductions
from .errors import StageError, instruction_error
from .process import CHANNEL_METHODS, bypass_ray_wrappers, match_niceness, serialize_calls
from .fill import FillRunner
from .grid import DeviceGrid
from .program import Instr
from .protocol import ALL_GATHER, FEED, FLUSH, OPTIMIZER_STEP, StepCall, StepReply, dp_reduce_entry
from .reuse import Reusable
from .stage_exec import Slot, backward_full, backward_input, backward_weight, detach_for_next, forward
from .state import WorkerState, actor_gpu, limit_memory
from .step_inputs import StepInputs, step_inputs
from .step_state import StepState
from .tensor_parallel import apply_plan, check_optimizer, whole as gathered
from .ties import TiedCopies
from .timing import device_timer
from .transfers import Transfers
from .update import LossScale, Recipe, Update, autocast_dtype, counted_params, update
from .zero import average_gradients, build_optimizers, gather_from_owners
from .values import to_device

__all__ = ["StageWorker"]

_COMPUTE = (Kind.F, Kind.B, Kind.I, Kind.W)  # what runs the last stage's loss or its backward


class StageWorker(Transfers, WorkerState, Reusable):
    def __init__(self, *, rank: int, replica: int, num_ranks: int, device: str, seed: int = 0,
                 niceness: Optional[int] = None, memory_fraction: float = 1.0, dp: int = 1, tp: int = 1,
                 tp_rank: int = 0) -> None:
        self.rank, self.replica, self.num_ranks, self.tp_rank = rank, replica, num_ranks, tp_rank
        self.niceness = match_niceness(niceness)
        self.call_lock = threading.RLock()  # Note [step channel] in actors/channel.py
        self._channel: Optional[ChannelServer] = None
        self.grid = DeviceGrid(dp=dp, pp=num_ranks, tp=tp)  # Note [device grid] in actors/grid.py
        self.global_rank = self.grid.actor(replica, rank, tp_rank)
        self.device = torch.device("cpu") if device != "cuda" else torch.device("cuda", actor_gpu())
        self.memory_fraction = limit_memory(self.device, memory_fraction)  # a shared GPU's share (actors/state.py)
        torch.manual_seed(seed)
        self.comm: Optional[Communicator] = None
        self.programs: dict[str, list[Instr]] = {}
        self.timer = device_timer(self.device)  # Note [device timing] in actors/timing.py
        self.prep = StepInputs.for_device(self.device)  # Note [step inputs] in actors/step_inputs.py
        self.fill = FillRunner()  # chunks on a stream of their own (Note [device timing])
        self.modules: dict[int, torch.nn.Module] = {}
        self.optimizers: dict[int, torch.optim.Optimizer] = {}  # one per stage: checkpoints are per stage
        self.tied: dict[int, TiedCopies] = {}  # tie index -> the local copies of its parameters
        self.schedulers: dict = {}  # stage -> its optimizer's LR scheduler
        self.reductions: dict = {}  # stage -> its StageReduction (Note [overlapped dp reduction])
        self._arm_at: dict[str, dict[int, int]] = {}  # program -> {position of a stage's last backward: stage}
        self.recipe, self.dp, self.loss_scale, self.autocast, self.counted = Recipe(), 1, None, None, []
        self._init_transfers()  # shapes learned, receives posted early (actors/transfers.py)
        self.current = StepState()  # the step running, or the last one
        self.feed = None  # actors/feed.py: where fed steps get their batch
        self._mode: Optional[bool] = None  # the modules' train mode, set when a step needs the other one
        bypass_ray_wrappers(self)  # Note [Ray's method wrappers] in actors/process.py
        # Note [decoded programs]: what runs each kind of instruction (bound once, unwrapped).
        self._handlers = {Kind.F: self._forward, Kind.B: self._backward, Kind.I: self._backward_input,
                          Kind.W: self._backward_weight, Kind.SEND_F: self._send_forward,
                          Kind.RECV_F: self._recv_forward, Kind.SEND_B: self._send_backward,
                          Kind.RECV_B: self._recv_backward, Kind.ALLREDUCE: self._average, Kind.FILL: self._run_fills,
                          Kind.TIE_REDUCE: self._tie_reduce, Kind.FREE: self._free}
        self._run_at: dict[str, list] = {}  # program -> per position, what runs its instruction

    # -- set-up (once) -------------------------------------------------------------------------
    def open_channel(self, key: bytes, controller_ip: str) -> tuple[str, int]:
        """Listen for the controller's step channel, keyed (Note [step channel]); its address."""
        here = node_ip()  # loopback when the controller is on this node
        self._channel = ChannelServer(self._channel_call, "127.0.0.1" if here == controller_ip else here, key)
        return self._channel.address

    def _channel_call(self, method: str, args: tuple):
        if method not in CHANNEL_METHODS:
            raise RuntimeError(f"{method!r} cannot be called over the step channel")
        return getattr(self, method)(*args)

    def _plan_of(self, s: int, tp_plans: Optional[dict]):
        """Stage ``s``'s TP plan as a function of its module (None without TP)."""
        if not tp_plans:
            return None
        return lambda module: apply_plan(module, tp_plans.get(s), self.comm.tp_mesh, s)

    def init_comm(self, *, world_size: int, address: tuple[str, int], backend: str, timeout_s: float,
                  dp_groups: list[list[int]], tie_groups: list[list[int]] = (), staged: bool = False,
                  queued: bool = False, p2p_groups: list[list[int]] = ()) -> None:
        self.comm = Communicator(world_size=world_size, rank=self.global_rank, address=tuple(address),
                                 backend=backend, timeout_s=timeout_s, dp_groups=dp_groups, device=self.device,
                                 tie_groups=tie_groups, staged=staged, queued=queued, tp_groups=self.grid.tp_groups(),
                                 p2p_groups=p2p_groups)

    def setup(self, *, modules: dict, optimizer, loss_fn, num_stages: int, num_microbatches: int,
              bucket_bytes: int, ties: tuple = (), side_takes: Optional[dict] = None,
              loss_takes: Optional[tuple] = (), recipe: Recipe = Recipe(), lr_scheduler=None, dp: int = 1,
              zero: int = 0, tp_plans: Optional[dict] = None, overlap_reduce: bool = True) -> None:
        """``modules``: stage -> module, the module pickled on its own (``bytes``), so that
        stages sharing a parameter each get their own copy (``ties``: the ``TieGroup``s of
        the local stages; Note [tie reduction] in schedules/passes.py), or a ``StageFactory``
        built here (Note [stage factories] in actors/build.py).  ``overlap_reduce``: with ``dp > 1``,
        each stage's gradient average starts inside its last backward (Note [overlapped dp reduction])."""
        # Under TP a stage is sharded before it moves to the device: each weight goes there one
        # at a time and only its shard stays (Note [tensor parallelism] in actors/tensor_parallel.py).
        # Under TP a stage is sharded before it moves to the device, or built sharded (Note
        # [sharded build] in actors/build.py; Note [tensor parallelism] in actors/tensor_parallel.py).
        self.modules = {int(s): load_stage(int(s), m, self.device, self.global_rank, shard=self._plan_of(int(s), tp_plans))
                        for s, m in sorted(modules.items())}
        self.tied = {tie.index: TiedCopies(tie, self.modules) for tie in ties}
        # Side inputs each stage's forward and the loss take by keyword (None: all; mpmd/runtime/side.py).
        self.side_takes, self.loss_takes = side_takes or {}, loss_takes
        for m in self.modules.values():
            m.train()
        self._mode = True
        # One optimizer per stage (per-parameter optimizers such as AdamW behave the same), so a
        # stage's optimizer state moves with it to any actor layout (mpmd/checkpoint.py); under
        # zero=1 a shard of it (self.zero: stage -> ZeroStage, Note [ZeRO-1 sharding] in actors/zero.py).
        tied = {id(p) for t in self.tied.values() for copies in t.copies for p in copies}
        self.optimizers, self.zero = build_optimizers(self.modules, optimizer, self.replica, dp, zero, tied)
        for s, opt in self.optimizers.items():
            check_optimizer(opt, s)  # kernels DTensor cannot run (Note [tensor parallelism])
        self.schedulers = {s: lr_scheduler(opt) for s, opt in self.optimizers.items()} if lr_scheduler else {}
        self.recipe, self.dp = recipe, dp
        self.loss_scale = LossScale() if recipe.precision == "fp16" else None
        dtype = autocast_dtype(recipe.precision)
        self.autocast = (self.device.type, dtype) if dtype is not None else None
        self.counted = counted_params(self.modules, ties, self.zero if zero else None, self.tp_rank)
        self.loss_fn = loss_fn
        self.num_microbatches = num_microbatches
        self.num_stages = num_stages
        self.bucket_bytes = bucket_bytes
        for red in self.reductions.values():
            red.disarm()
        self.reductions = stage_reductions(self.modules, self.zero, self.comm, bucket_bytes) if overlap_reduce else {}

    def set_program(self, name: str, data: bytes) -> int:
        n = super().set_program(name, data)
        self._arm_at[name] = last_backwards(self.programs[name])  # Note [overlapped dp reduction]
        self._run_at[name] = [functools.partial(self._compute, self._handlers[ins.kind]) if ins.kind in _COMPUTE
                              else self._handlers[ins.kind] for ins in self.programs[name]]  # Note [decoded programs]
        return n

    def attach_feed(self, feed) -> None:
        """From now on, training steps given no data pull it through ``feed`` (a ``Feed`` or a
        ``TargetsFrom``, Note [fed steps] in actors/feed.py); None stops that."""
        if self.feed is not None:
            self.feed.close()
        self.feed = feed
        if feed is not None:
            feed.start()

    def tie_layouts(self) -> dict:
        """Per tie here, how a TP plan laid out its parameters (the engine compares across actors)."""
        return {i: t.layouts() for i, t in self.tied.items()}

    def register_fill_job(self, job_id: int, fn, collate: bool, data) -> None:
        self.fill.register(job_id, fn, collate, data)

    def drop_fill_jobs(self, job_ids: list) -> None:
        self.fill.drop(job_ids)

    def take_fill_outputs(self) -> dict:
        return self.fill.take_outputs()

    # -- one step ----------------------------------------------------------------------------
    def run_call(self, call: tuple, inputs=None, targets=None, fills: Optional[dict] = None,
                 side: Optional[tuple] = None) -> Optional[tuple]:
        """Run instructions ``[call.start, call.end)`` of program ``call.program`` for ``call.step``.

        ``call`` is a ``StepCall`` as a plain tuple, and the ``StepReply`` goes back as one
        (Note [plain tuples on the wire] in ``actors/protocol.py``).  ``call.start == 0``
        begins the step: ``inputs`` for the first stage, ``targets`` for the last,
        ``fills`` assigns PipeFill chunks to this step's ``FILL`` slots (``{slot:
        FillSlot}``), ``side`` holds the step's side inputs for the local stages
        (``(per microbatch, whole)``).  ``call.last`` ends it and returns the reply.  The
        arguments are positional: Ray checks and flattens each keyword argument of every call."""
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
        if call.last:
            return tuple(self._finish(cpu))
        if cur.profile:
            cur.cpu_ns += time.thread_time_ns() - cpu
        return None

    def _begin(self, call: StepCall, inputs, targets, fills: Optional[dict], side: Optional[tuple]) -> None:
        if call.program not in self.programs:
            raise RuntimeError(f"no program named {call.program!r} was shipped to rank {self.rank}")
        train = call.program == "train"
        self.comm.first_step = call.relearn  # more patience while pairs connect (Note [stuck operations])
        fed = train and self.feed is not None and inputs is None and targets is None  # Note [fed steps]
        if call.profile:
            self.timer.begin()  # before the step pulls or posts anything (Note [device sync])
        t0, c0 = (self.timer.mark(), time.thread_time_ns()) if call.profile and fed else (0, 0)
        inputs, targets, per_mb, whole = step_inputs(  # pinned, uploaded once: Note [step inputs]
            self.prep, inputs, targets, side, (lambda keep: self.feed.pull(self.comm, keep, call.step)) if fed else None)
        self.current = StepState(program=call.program, step=call.step, relearn=call.relearn, profile=call.profile,
                                 train=train, collect=call.collect, inputs=inputs, targets=targets,
                                 fills=fills or {}, side=per_mb, side_whole=whole, peers=self._peers[call.program])
        if call.profile and fed:  # the batch's cost on this actor: read, received or sent on
            self.current.timeline.append((FEED, t0, self.timer.mark()))
            self.current.slices_cpu_ns += time.thread_time_ns() - c0
        torch.set_grad_enabled(train)
        if train is not self._mode:  # only here and in setup; walking every module took ~0.1 ms a step
            for m in self.modules.values():
                m.train(train)
            self._mode = train
        for red in self.reductions.values():  # a failed step may have left one armed
            red.disarm()
        self._prefetch()

    def _finish(self, cpu: int) -> StepReply:
        """End the step; ``cpu``: this thread's CPU clock when the call ending it began."""
        cur = self.current
        if cur.profile:
            t0, blocked, c0 = self.timer.mark(), self.comm.blocked_ns, time.thread_time_ns()
            self.comm.flush()
            cur.timeline.append((FLUSH, t0, self.timer.mark()))
            cur.waited.append((FLUSH, self.comm.blocked_ns - blocked))
            cur.slices_cpu_ns += time.thread_time_ns() - c0
        else:
            self.comm.flush()
        done = Update(skipped=False, grad_norm=None, lr=None)
        if cur.train:  # Note [agreed update] in actors/update.py: every actor decides alike
            t0, c0 = (self.timer.mark(), time.thread_time_ns()) if cur.profile else (0, 0)
            finite = bool(torch.isfinite(torch.stack(cur.losses)).all()) if cur.losses else True
            done = update(self.optimizers, self.schedulers, self.counted, self.comm, self.recipe, finite,
                          1 if self.zero else self.dp, self.loss_scale, self._gather if self.zero else None)
            for p in (p for zs in self.zero.values() for p in zs.params):  # a tie's copies owned elsewhere
                p.grad = None
            if cur.profile:  # the optimizer step ends where ZeRO-1's all-gather begins
                cur.timeline.append((OPTIMIZER_STEP, t0, self.timer.mark() if cur.gathered is None else cur.gathered))
                cur.slices_cpu_ns += time.thread_time_ns() - c0  # the all-gather's too
        torch.set_grad_enabled(True)
        first = not self.tp_rank  # TP ranks compute the same loss and outputs: one reports them
        timeline = self.timer.resolve(cur.timeline) if cur.profile else cur.timeline
        reply = StepReply(losses=torch.stack(cur.losses).tolist() if cur.losses and first else [], timeline=timeline,
                          window=(cur.entered_ns, time.time_ns(), cur.cpu_ns + time.thread_time_ns() - cpu,
                                  cur.slices_cpu_ns) if cur.profile else (), waited=tuple(cur.waited),
                          skipped=done.skipped, grad_norm=done.grad_norm, lr=done.lr,
                          outputs=[cur.outputs[m] for m in sorted(cur.outputs)] if cur.outputs and first else None,
                          fills=tuple(cur.fill_results))
        # The step's buffers go now, not when the next step begins.
        self.current = StepState(program=cur.program, step=cur.step)
        return reply

    def _gather(self) -> None:  # ZeRO-1's all-gather (Note [ZeRO-1 sharding]), timed apart when profiling
        cur = self.current
        cur.gathered = self.timer.mark() if cur.profile else None  # Note [device timing] in actors/timing.py
        for s in sorted(self.zero):
            gather_from_owners(self.comm, self.zero[s], self.bucket_bytes)
        if cur.profile:
            cur.timeline.append((ALL_GATHER, cur.gathered, self.timer.mark()))

    # -- instructions ------------------------------------------------------------------------
    def _slot(self, buf: int) -> Slot:
        slots = self.current.slots
        slot = slots.get(buf)
        if slot is None:
            slot = slots[buf] = Slot()
        return slot

    # Note [decoded programs]: ``set_program`` resolves, per position, the bound method that runs
    # the instruction (and ``Transfers`` each send's and receive's peer), so the interpreter
    # indexes a list instead of testing the kind against each branch and asking the grid for
    # the peer, every instruction.
    def _compute(self, run, ins: Instr) -> None:
        if self.recipe.loss_parallel and ins.stage == self.num_stages - 1:
            # the loss on vocabulary shards, forward and backward (Note [vocabulary-parallel loss] in
            # mpmd/tensor_parallel/builtin.py)
            with loss_parallel():
                run(ins)
        else:
            run(ins)

    def _backward(self, ins: Instr) -> None:
        self._arm(self.current.pc)
        backward_full(self.current.slots[ins.buf])
        self._hand_back(ins)

    def _backward_input(self, ins: Instr) -> None:
        backward_input(self.modules[ins.stage], self.current.slots[ins.buf])
        self._hand_back(ins)

    def _backward_weight(self, ins: Instr) -> None:
        self._arm(self.current.pc)
        backward_weight(self.modules[ins.stage], self.current.slots[ins.buf])

    def _tie_reduce(self, ins: Instr) -> None:
        self.tied[ins.tie_group].reduce(self.comm, self.bucket_bytes)

    def _free(self, ins: Instr) -> None:
        self.current.slots.pop(ins.buf, None)

    def _arm(self, pc: int) -> None:
        """Before a backward: when it is its stage's last, the stage's buckets start as their
        gradients become final (Note [overlapped dp reduction])."""
        stage = self._arm_at[self.current.program].get(pc)
        if stage is not None and stage in self.reductions:
            self.reductions[stage].arm(self.timer.mark if self.current.profile else None)

    def _average(self, ins: Instr) -> None:
        """The replicas' mean of stage ``ins.stage``: all-reduced, or reduce-scattered under ZeRO-1."""
        stage = ins.stage
        red = self.reductions.get(stage)
        if red is None:
            average_gradients(self.comm, self.modules[stage], self.zero.get(stage), self.bucket_bytes)
            return
        first = red.finish()
        cur = self.current
        if cur.profile and first is not None:  # from the first bucket's start to the wait's end
            cur.timeline.append((dp_reduce_entry(cur.pc), first, self.timer.mark()))

    def _forward(self, ins: Instr) -> None:
        cur = self.current
        slot = self._slot(ins.buf)
        if ins.stage == 0:
            slot.inp = to_device(cur.inputs[ins.microbatch], self.device)
        elif slot.inp is None:
            raise RuntimeError("forward before its input arrived (no RECV_F or local hand-off)")
        last = ins.stage == self.num_stages - 1
        target = None
        if last and cur.targets is not None:
            target = to_device(cur.targets[ins.microbatch], self.device)
        loss_fn = self.loss_fn if last and not cur.collect else None
        scale = self.loss_scale.scale if self.loss_scale is not None and cur.train else 1.0
        forward(self.modules[ins.stage], slot, target, loss_fn, scale / self.num_microbatches,
                cur.side_kwargs(self.side_takes.get(ins.stage, ()), ins.microbatch),
                cur.side_kwargs(self.loss_takes, ins.microbatch) if loss_fn is not None else None,
                autocast=self.autocast, boundary=not last, recompute=cur.train and ins.stage in self.recipe.recompute,
                split=(ins.stage, ins.microbatch) in self._split_backwards[cur.program])
        if slot.loss is not None:
            cur.losses.append(slot.loss.detach().float() * (self.num_microbatches / scale))
        if last and cur.collect:  # logits sharded over the vocabulary come back whole
            cur.outputs[ins.microbatch] = to_device(gathered(slot.out), torch.device("cpu"))
        if ins.aux >= 0:  # the next stage lives here too: hand the output over directly
            nxt = self._slot(ins.aux)
            nxt.inp, nxt.inp_grad = detach_for_next(slot.out, cur.train)

    def _hand_back(self, ins: Instr) -> None:
        if ins.aux >= 0:  # the previous stage lives here too
            self._slot(ins.aux).grad_out = self.current.slots[ins.buf].grad_in

    def _error(self, index: int, ins: Instr, exc: BaseException) -> StageError:
        cur = self.current
        slot = cur.slots.get(ins.buf)
        return instruction_error(exc, rank=self.rank, replica=self.replica, step=cur.step, program_name=cur.program,
                                 program=self.programs[cur.program], index=index,
                                 stage_input=slot.inp if ins.kind is Kind.F and slot is not None else None,
                                 nccl=self.comm is not None and self.comm.backend == "nccl")

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.comm is not None:
            self.comm.close()
            self.comm = None


serialize_calls(StageWorker)
