"""``Engine``: the controller's runtime under ``mpmd.Pipeline``.

It runs the steps: issuing a step's calls and completing them into a ``StepResult`` (step
counting and the non-finite-loss policy happen here and nowhere else), switching how steps
are cut into calls, installing a (re)compiled program, the pipeline's state dict.  It holds
the ``Fleet`` (``fleet.py``: the actors and everything of their lifetime: launch, set-up,
restarts, teardown) and the ``ActorClient`` (``client.py``: every other call to the actors).
``mpmd.Pipeline`` is a thin facade over it; the features around it (fit and checkpoints,
the profiler, PipeFill, the benchmarks) use its public methods, its fleet and its client.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import torch

from actors.expert_setup import check_experts
from actors.grid import DeviceGrid
from actors.program import Instr
from schedules import Schedule

from ..errors import StageFailedError
from .batches import FED, Batching, MicrobatchSplit, batch_size, signature
from .checks import (check_inputs, check_state_dict, explain_stage_failure, finite_loss, nonfinite_loss_error,
                     record_inputs, warn_user)
from .client import ActorClient
from .compile import FORWARD, TRAIN, lower_for_training, segments
from .config import FUSION_MODES, PipelineConfig
from .cp import check_cp_pipeline, check_cp_step, join_cp_outputs
from .dispatch import DispatchStats, IssuedStep
from .fleet import Fleet
from .results import PendingStep, StepResult
from .stage_source import Stages, resolve_stages
from .state import StateKeys
from .ties import Tie

__all__ = ["Engine", "TRAIN", "FORWARD"]


class _Issued(NamedTuple):
    """A step whose calls are out, with what completing it needs."""

    calls: IssuedStep
    program: str
    step: int
    signature: tuple
    inputs: tuple  # record_inputs of the first microbatch
    collect: bool


class Engine:
    """Programs and steps of one pipeline on its ``fleet`` of actors (see the module docstring).

    ``stages`` (modules and/or factories, or a ``StageSource``) run in order under ``schedule``
    (validated, placed); ``loss_fn`` and ``optimizer`` are shipped to the actors as given;
    ``batching`` splits a step's batch (default ``MicrobatchSplit``).  Nothing starts until ``start``.
    """

    def __init__(self, stages: Stages, schedule: Schedule, config: PipelineConfig, *,
                 loss_fn: Optional[Callable], optimizer: Optional[Callable], lr_scheduler: Optional[Callable] = None,
                 batching: Optional[Batching] = None, tp_plans: Optional[list] = None) -> None:
        source = resolve_stages(stages, config.recipe.seed)  # modules and/or factories (Note [stage factories])
        check_experts(enumerate(source.modules), config.layout.ep, whole=True)  # a factory's on meta: its structure
        self.batching: Batching = batching if batching is not None else MicrobatchSplit()
        check_cp_pipeline(source.modules, config.layout, loss_fn, sliced=not isinstance(self.batching, MicrobatchSplit),
                          planned=False)  # Note [context-parallel runtime] in actors/cp_runtime.py
        if config.layout.tp > 1 and not isinstance(self.batching, MicrobatchSplit):  # a GPTStage's K/V cache is not sharded
            raise ValueError("TeraPipe's token slices are not supported with tp > 1; use tp=1 or another schedule")
        self.fleet = Fleet(source, schedule, config, loss_fn=loss_fn, optimizer=optimizer, lr_scheduler=lr_scheduler,
                           tp_plans=tp_plans)
        self.client = ActorClient(self.fleet)
        self.state_keys = StateKeys(source.modules)
        self.skipped_steps: list[int] = []  # steps whose non-finite loss was skipped (on_nan="skip")
        self.moe_metrics: dict = {}  # the last training step's StepResult.moe_metrics (docs/moe.md)
        self._steps = 0  # training steps issued (restored from checkpoints): step_count
        self._segments: dict[str, list] = {}  # per program, each rank's calls (set_fusion)
        self._cut_into_calls()
        self._first_inputs = None  # structure, shapes and dtypes of the first step's inputs (checks.py)
        self._signatures: dict[str, tuple] = {}
        self.fleet.on_restart(self._forget_signatures)  # fresh actors learn the shapes again

    # -- what runs -------------------------------------------------------------------------------
    stages = property(lambda self: self.fleet.source.modules)  # structure only: a factory's is on meta
    schedule = property(lambda self: self.fleet.schedule)
    config = property(lambda self: self.fleet.config)
    loss_fn = property(lambda self: self.fleet.loss_fn)

    @property
    def ties(self) -> list[Tie]:  # parameters stages share (Note [tie reduction])
        return self.fleet.ties

    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def grid(self) -> DeviceGrid:  # which actor is which, and the groups (Note [device grid])
        return self.fleet.grid

    num_actors = property(lambda self: self.fleet.num_actors)

    def rank_of(self, actor: int) -> int:
        """The pipeline rank of actor ``actor`` (actors are replica-major)."""
        return self.fleet.rank_of(actor)

    def program(self, name: str) -> list[list[Instr]]:
        """The compiled program ``name`` per pipeline rank (as shipped)."""
        return list(self.fleet.programs[name])

    def lower_train(self) -> Schedule:
        """The training schedule lowered as this pipeline runs it (``lower_for_training``)."""
        return lower_for_training(self.schedule, self.config.layout.reducing, self.fleet.tied_stages)

    # -- start, programs, stop -------------------------------------------------------------------
    def start(self) -> None:
        """Connect to (or start) Ray, launch the actors and ship modules and programs."""
        self.fleet.start()

    def shutdown(self) -> None:
        """Stop the actors.  A Ray this pipeline did not start keeps running."""
        self.fleet.shutdown()

    def install_program(self, name: str, lowered: Schedule) -> list[list[Instr]]:
        """Compile the lowered schedule ``lowered``, ship it to every actor as program
        ``name`` (kept across restarts) and use it from the next step; its programs."""
        programs = self.fleet.install_program(name, lowered)
        self._segments[name] = [segments(p, self.config.dispatch.fusion) for p in programs]
        return programs

    def reschedule(self, schedule: Schedule, config: PipelineConfig, batching: Batching) -> None:
        """Set the actors up again, from the stages' first state, to run ``schedule`` (same ranks,
        dp), counting steps from 0."""
        self.batching = batching
        self._first_inputs, self._signatures, self.skipped_steps = None, {}, []
        self.resume_at(0)
        self.fleet.reschedule(schedule, config)
        self._cut_into_calls()

    def _forget_signatures(self) -> None:
        self._signatures = {}

    # -- step count ------------------------------------------------------------------------------
    @property
    def step_count(self) -> int:
        """Training steps issued (this engine counts them; a checkpoint's load sets it)."""
        return self._steps

    def resume_at(self, step: int) -> None:
        """Count steps from ``step`` on (a checkpoint's, or 0)."""
        self._steps = int(step)

    # -- how steps are cut into calls --------------------------------------------------------------
    def set_fusion(self, fusion: str, *, step_channel: Optional[bool] = None, bare_calls: bool = True) -> None:
        """Cut each program into calls per ``fusion`` ("step", "consecutive", "none") from the
        next step on; ``step_channel`` (with "step") sends the call over the step channel
        (where open) or, False, as a Ray task; ``bare_calls=False`` pickles every channel call
        on its own (Note [bare calls], for benchmarks).  Actors and programs stay the same."""
        if fusion not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {fusion!r}; use one of {', '.join(FUSION_MODES)}")
        self.fleet.replace_config(dispatch=dataclasses.replace(self.config.dispatch, fusion=fusion))
        dispatch = self.fleet.dispatch
        if dispatch is not None:
            dispatch.bare_calls = bare_calls
        if step_channel is not None and dispatch is not None:
            dispatch.use_channel = step_channel
        self._cut_into_calls()

    def _cut_into_calls(self) -> None:
        fusion = self.config.dispatch.fusion
        self._segments = {name: [segments(p, fusion) for p in progs] for name, progs in self.fleet.programs.items()}

    @property
    def uses_step_channel(self) -> bool:
        """Whether one-call steps go over the step channels (Note [step channel])."""
        dispatch = self.fleet.dispatch
        return dispatch is not None and dispatch.channels is not None and dispatch.use_channel

    @property
    def last_dispatch(self) -> DispatchStats:
        """What issuing the last step cost the controller: wall and CPU seconds, calls."""
        dispatch = self.fleet.dispatch
        return dispatch.last if dispatch is not None else DispatchStats(0.0, 0.0, 0, 0)

    # -- steps ---------------------------------------------------------------------------------------
    def train_step(self, inputs: Any, targets: Any, *, side: Optional[dict] = None, profile: bool = False,
                   fills: Optional[list] = None, while_waiting: Optional[Callable[[], None]] = None) -> StepResult:
        """One optimizer step; ``while_waiting()`` runs on the controller once the calls are out."""
        return self.train_step_async(inputs, targets, side=side, profile=profile, fills=fills).wait(while_waiting)

    def train_step_async(self, inputs: Any, targets: Any, *, side: Optional[dict] = None, profile: bool = False,
                         fills: Optional[list] = None) -> "PendingStep":
        """Issue one optimizer step and return at once; it is counted now, its loss checked
        (``on_nan``) when it completes.  ``side``: side inputs by name (``side.py``)."""
        if self.loss_fn is None:
            raise ValueError("step needs a loss_fn: Pipeline(..., loss_fn=torch.nn.functional.mse_loss)")
        issued = self._issue(TRAIN, inputs, targets, side=side, profile=profile, fills=fills, step=self._steps)
        self._steps += 1
        return PendingStep(issued.step, lambda while_waiting: self._complete(issued, while_waiting))

    def run(self, name: str, inputs: Any, targets: Any, *, side: Optional[dict] = None,
            collect: bool = False) -> StepResult:
        """Run program ``name`` (e.g. ``"forward"``) on a batch; parameters change only if it trains."""
        return self._complete(self._issue(name, inputs, targets, side=side, collect=collect, step=self._steps))

    def _issue(self, name: str, inputs: Any, targets: Any, *, step: int, side: Optional[dict] = None,
               collect: bool = False, profile: bool = False, fills: Optional[list] = None) -> _Issued:
        """Check and split the batch, issue the step's calls; ``_complete`` waits for them."""
        self.fleet.check_open()
        cfg = self.config
        parts = self.schedule.num_microbatches * cfg.layout.dp
        if inputs is FED:  # the actors pull the batch (Note [fed steps] in actors/feed.py)
            mb_in, mb_tg, got, sig = None, None, None, ("fed",)
        else:
            mb_in, mb_tg = self.batching.split(inputs, targets, parts, f"num_microbatches={self.schedule.num_microbatches} "
                                               f"x dp={cfg.layout.dp}")
            check_cp_step(cfg.layout, inputs, targets, side)  # before anything is sent
            got = record_inputs(mb_in[0])
            check_inputs(self.stages, self._first_inputs, got)
            sig = (signature(mb_in[0]), signature(mb_tg[0]) if mb_tg else ())
        relearn = cfg.comm.dynamic_shapes or self._signatures.get(name) != sig
        calls = self.fleet.dispatch.issue_step(name, step, mb_in, mb_tg, relearn=relearn, segments=self._segments[name],
                                          collect=collect, profile=profile, fills=fills,
                                          side=self._side_per_actor(side, inputs) if side else None)
        return _Issued(calls, name, step, sig, got, collect)

    def _side_per_actor(self, side: dict, inputs: Any) -> list:
        if not isinstance(self.batching, MicrobatchSplit):
            raise ValueError("side inputs are not supported with token slices")
        spec, cfg = self.fleet.side, self.config
        always = ("position_ids",) if cfg.layout.document_mask else ()  # every stage's attention reads them
        spec.check([n for n in side if n not in always])
        return spec.per_actor(side, batch_size(inputs, "inputs"), self.schedule, cfg.layout.dp, self.schedule.num_microbatches, cfg.layout.tp,
                              cfg.layout.cp, always)

    def _complete(self, issued: _Issued, while_waiting: Optional[Callable[[], None]] = None) -> StepResult:
        try:
            if while_waiting is not None:
                while_waiting()
            replies = self.fleet.dispatch.finish_step(issued.calls, self.config.dispatch.step_timeout_s)
        except StageFailedError as e:
            if issued.inputs is None:  # a fed step: the controller never saw its inputs
                raise
            raise explain_stage_failure(e, self.stages, issued.inputs, self._first_inputs) from None
        except KeyboardInterrupt:
            self.fleet.abort()
            raise
        self._signatures[issued.program] = issued.signature
        if self._first_inputs is None:
            self._first_inputs = issued.inputs
        losses = tuple(x for r in replies for x in r.losses)
        outputs = None
        if issued.collect:
            outputs = self.batching.join(join_cp_outputs(self.fleet.grid, [r.outputs for r in replies]))
        result = StepResult(program=issued.program, step=issued.step,
                            loss=sum(losses) / len(losses) if losses else None, losses=losses,
                            replies=tuple(replies), outputs=outputs)
        if issued.program == TRAIN:
            self.moe_metrics = result.moe_metrics
            self._check_loss(result)
        return result

    def _check_loss(self, result: StepResult) -> None:
        """``on_nan``: a step the actors agreed not to apply (Note [agreed update]) raises or is
        skipped with a warning; with fp16 a gradient overflow at a finite loss is the loss
        scale's to handle (it halved)."""
        finite = finite_loss(result.loss, list(result.losses))
        if finite and not result.skipped:
            return
        self.skipped_steps.append(result.step)
        if finite and self.fleet.recipe.precision == "fp16":
            return
        if self.config.recipe.on_nan == "raise":
            raise nonfinite_loss_error(result.step, result.loss, list(result.losses), result.grad_norm)
        cause = "" if not finite else " but a gradient is not finite"
        warn_user(f"step {result.step}: the loss is {result.loss}{cause}; skipped it (parameters, optimizer and LR "
                  f"scheduler state unchanged)")

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Parameters and buffers with the keys of ``nn.Sequential(*stages).state_dict()``, or
        the model's own keys (``StateKeys``); whole tensors (under TP gathered by each TP group)."""
        return self.state_keys.merge(self.client.stage_states())

    def load_state_dict(self, state_dict: dict) -> None:
        check_state_dict(self.state_keys.merge(self.client.stage_shapes()), state_dict)  # no tensors move
        self.state_keys.check_tied_values(self.ties, state_dict)
        # whole tensors: each TP rank keeps its part (Note [tensor parallelism])
        self.client.load_stage_states(self.state_keys.split(state_dict))
