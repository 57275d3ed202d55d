"""``Engine``: the controller's runtime under ``mpmd.Pipeline``.

It owns the actors and everything about a step: launching the actors and shipping the
stage modules and programs, installing a (re)compiled program, issuing a step's calls
and completing them into a ``StepResult`` (step counting and the non-finite-loss policy
happen here and nowhere else), switching how steps are cut into calls, restarts and
teardown (the actors' lifetime: ``lifetime.py``).  ``mpmd.Pipeline`` is a thin facade over
it; the features around it (fit and checkpoints, the profiler, PipeFill, the benchmarks)
use its public methods.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, NamedTuple, Optional, Sequence

import torch

from actors.grid import DeviceGrid
from actors.program import Instr
from schedules import Schedule

from ..errors import StageFailedError
from .batches import FED, Batching, MicrobatchSplit, batch_size, signature
from .checks import (check_inputs, check_state_dict, explain_stage_failure, finite_loss, nonfinite_loss_error,
                     record_inputs, warn_user)
from .compile import FORWARD, TRAIN, lower_for_training, pipeline_programs, segments
from .config import FUSION_MODES, PipelineConfig, recipe_of
from .dispatch import DispatchStats, Dispatcher, IssuedStep
from .lifetime import Lifetime
from .results import PendingStep, StepResult
from .side import side_spec
from .spares import SparePool
from .stage_source import Stages, resolve_stages
from .state import StateKeys, gather_state, load_state
from .ties import find_ties

__all__ = ["Engine", "TRAIN", "FORWARD"]


class _Issued(NamedTuple):
    """A step whose calls are out, with what completing it needs."""

    calls: IssuedStep
    program: str
    step: int
    signature: tuple
    inputs: tuple  # record_inputs of the first microbatch
    collect: bool


class Engine(Lifetime):
    """Actors, programs and steps of one pipeline (see the module docstring).

    ``stages`` (modules and/or factories, or a ``StageSource``) run in order under ``schedule``
    (validated, placed); ``loss_fn`` and ``optimizer`` are shipped to the actors as given;
    ``batching`` splits a step's batch (default ``MicrobatchSplit``).  Nothing starts until ``start``.
    """

    def __init__(self, stages: Stages, schedule: Schedule, config: PipelineConfig, *,
                 loss_fn: Optional[Callable], optimizer: Optional[Callable], lr_scheduler: Optional[Callable] = None,
                 batching: Optional[Batching] = None, tp_plans: Optional[list] = None) -> None:
        self.source = resolve_stages(stages, config.seed)  # modules and/or factories (Note [stage factories])
        self.stages = self.source.modules  # structure only: a factory's stage is on the meta device here
        self.schedule, self.config = schedule, config
        self.loss_fn, self.optimizer_factory, self.lr_scheduler = loss_fn, optimizer, lr_scheduler
        self.recipe = recipe_of(config, len(self.stages))
        self.batching: Batching = batching if batching is not None else MicrobatchSplit()
        if config.tp > 1 and not isinstance(self.batching, MicrobatchSplit):  # a GPTStage's K/V cache is not sharded
            raise ValueError("TeraPipe's token slices are not supported with tp > 1; use tp=1 or another schedule")
        self.step_count = 0  # training steps issued (restored from checkpoints)
        self.skipped_steps: list[int] = []  # steps whose non-finite loss was skipped (on_nan="skip")
        self.actors: list = []
        self.device: Optional[str] = None
        self.ties = find_ties(self.stages)  # parameters stages share (Note [tie reduction])
        self.tp_plans = tp_plans or [None] * len(self.stages)  # resolve_plans's (Note [tensor parallelism])
        self._tied = [t.stages for t in self.ties]  # each tie's stages, for lowering
        self.state_keys = StateKeys(self.stages)
        self.side = side_spec(self.stages, loss_fn)  # the side inputs each stage and the loss take
        self._programs = pipeline_programs(schedule, self.config.dp, self._tied)
        self._segments: dict[str, list] = {}
        self._first_inputs = None  # structure, shapes and dtypes of the first step's inputs (checks.py)
        self._signatures: dict[str, tuple] = {}
        self._restart_hooks: list[Callable[[], None]] = []
        self._dispatch: Optional[Dispatcher] = None
        self._pg = None
        self._pool = None  # where the actors park at shutdown (Note [reused actors] in pool.py)
        self.spares = SparePool(config.spare_actors, self.grid, config.seed)  # Note [spare actors]
        self._closed = False
        self._owns_ray = False
        self.startup: dict[str, float] = {}  # seconds per phase of the last launch (lifetime.py)

    # -- shape -----------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    @property
    def grid(self) -> DeviceGrid:  # which actor is which, and the groups (Note [device grid])
        return DeviceGrid(dp=self.config.dp, pp=self.num_ranks, tp=self.config.tp)

    num_actors = property(lambda self: self.grid.size)

    def rank_of(self, actor: int) -> int:
        """The pipeline rank of actor ``actor`` (actors are replica-major)."""
        return self.grid.rank_of(actor)

    def program(self, name: str) -> list[list[Instr]]:
        """The compiled program ``name`` per pipeline rank (as shipped)."""
        return list(self._programs[name])

    def lower_train(self) -> Schedule:
        """The training schedule lowered as this pipeline runs it (``lower_for_training``)."""
        return lower_for_training(self.schedule, self.config.dp, self._tied)

    # -- how steps are cut into calls --------------------------------------------------------------
    def set_fusion(self, fusion: str, *, step_channel: Optional[bool] = None, bare_calls: bool = True) -> None:
        """Cut each program into calls per ``fusion`` ("step", "consecutive", "none") from the
        next step on; ``step_channel`` (with "step") sends the call over the step channel
        (where open) or, False, as a Ray task; ``bare_calls=False`` pickles every channel call
        on its own (Note [bare calls], for benchmarks).  Actors and programs stay the same."""
        if fusion not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {fusion!r}; use one of {', '.join(FUSION_MODES)}")
        self.config = dataclasses.replace(self.config, fusion=fusion)
        if self._dispatch is not None:
            self._dispatch.bare_calls = bare_calls
        if step_channel is not None and self._dispatch is not None:
            self._dispatch.use_channel = step_channel
        self._segments = {name: [segments(p, fusion) for p in progs] for name, progs in self._programs.items()}

    @property
    def uses_step_channel(self) -> bool:
        """Whether one-call steps go over the step channels (Note [step channel])."""
        return self._dispatch is not None and self._dispatch.channels is not None and self._dispatch.use_channel

    @property
    def last_dispatch(self) -> DispatchStats:
        """What issuing the last step cost the controller: wall and CPU seconds, calls."""
        return self._dispatch.last if self._dispatch is not None else DispatchStats(0.0, 0.0, 0, 0)

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
        issued = self._issue(TRAIN, inputs, targets, side=side, profile=profile, fills=fills, step=self.step_count)
        self.step_count += 1
        return PendingStep(issued.step, lambda while_waiting: self._complete(issued, while_waiting))

    def run(self, name: str, inputs: Any, targets: Any, *, side: Optional[dict] = None,
            collect: bool = False) -> StepResult:
        """Run program ``name`` (e.g. ``"forward"``) on a batch; parameters change only if it trains."""
        return self._complete(self._issue(name, inputs, targets, side=side, collect=collect, step=self.step_count))

    def _issue(self, name: str, inputs: Any, targets: Any, *, step: int, side: Optional[dict] = None,
               collect: bool = False, profile: bool = False, fills: Optional[list] = None) -> _Issued:
        """Check and split the batch, issue the step's calls; ``_complete`` waits for them."""
        self.check_open()
        cfg = self.config
        parts = cfg.num_microbatches * cfg.dp
        if inputs is FED:  # the actors pull the batch (Note [fed steps] in actors/feed.py)
            mb_in, mb_tg, got, sig = None, None, None, ("fed",)
        else:
            mb_in, mb_tg = self.batching.split(inputs, targets, parts, f"num_microbatches={cfg.num_microbatches} "
                                               f"x dp={cfg.dp}")
            got = record_inputs(mb_in[0])
            check_inputs(self.stages, self._first_inputs, got)
            sig = (signature(mb_in[0]), signature(mb_tg[0]) if mb_tg else ())
        relearn = cfg.dynamic_shapes or self._signatures.get(name) != sig
        calls = self._dispatch.issue_step(name, step, mb_in, mb_tg, relearn=relearn, segments=self._segments[name],
                                          collect=collect, profile=profile, fills=fills,
                                          side=self._side_per_actor(side, inputs) if side else None)
        return _Issued(calls, name, step, sig, got, collect)

    def _side_per_actor(self, side: dict, inputs: Any) -> list:
        if not isinstance(self.batching, MicrobatchSplit):
            raise ValueError("side inputs are not supported with token slices")
        self.side.check(list(side))
        cfg = self.config
        return self.side.per_actor(side, batch_size(inputs, "inputs"), self.schedule, cfg.dp, cfg.num_microbatches, cfg.tp)

    def _complete(self, issued: _Issued, while_waiting: Optional[Callable[[], None]] = None) -> StepResult:
        try:
            if while_waiting is not None:
                while_waiting()
            replies = self._dispatch.finish_step(issued.calls, self.config.step_timeout_s)
        except StageFailedError as e:
            if issued.inputs is None:  # a fed step: the controller never saw its inputs
                raise
            raise explain_stage_failure(e, self.stages, issued.inputs, self._first_inputs) from None
        except KeyboardInterrupt:
            self.abort()
            raise
        self._signatures[issued.program] = issued.signature
        if self._first_inputs is None:
            self._first_inputs = issued.inputs
        losses = tuple(x for r in replies for x in r.losses)
        outputs = None
        if issued.collect:
            outputs = self.batching.join([o for r in replies for o in (r.outputs or ())])
        result = StepResult(program=issued.program, step=issued.step,
                            loss=sum(losses) / len(losses) if losses else None, losses=losses,
                            replies=tuple(replies), outputs=outputs)
        if issued.program == TRAIN:
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
        if finite and self.recipe.precision == "fp16":
            return
        if self.config.on_nan == "raise":
            raise nonfinite_loss_error(result.step, result.loss, list(result.losses), result.grad_norm)
        cause = "" if not finite else " but a gradient is not finite"
        warn_user(f"step {result.step}: the loss is {result.loss}{cause}; skipped it (parameters, optimizer and LR "
                  f"scheduler state unchanged)")

    # -- calls to the actors -----------------------------------------------------------------------
    def wait(self, futures: list, what: str, *, owner: Optional[dict] = None,
             timeout_s: Optional[float] = None) -> list[Any]:
        """Wait for Ray calls to the actors; on the first failure tear the pipeline down and
        raise (``owner`` maps a call to its actor's index, else one call per actor in order)."""
        return self._dispatch.wait(futures, what, timeout_s=timeout_s, owner=owner)

    def call_actors(self, method: str, *args: Any, what: str, indices: Optional[Sequence[int]] = None,
                    **kwargs: Any) -> list[Any]:
        """``method(*args, **kwargs)`` on the actors ``indices`` (default: all) through Ray, after
        the steps in flight; their results in that order."""
        self.check_open()
        self.quiesce()
        indices = range(len(self.actors)) if indices is None else indices
        futures = {getattr(self.actors[i], method).remote(*args, **kwargs): i for i in indices}
        return self.wait(list(futures), what, owner=futures)

    def call_in_order(self, index: int, method: str):
        """Call ``method()`` on actor ``index`` after everything issued to it before, without
        waiting (over the step channel where open); ``result_of`` gets the result."""
        return self._dispatch.call(index, method)

    def result_of(self, handle, timeout_s: float) -> Any:
        return self._dispatch.get(handle, timeout_s)

    def quiesce(self) -> None:
        """Wait until every step issued has finished on the actors (results are kept)."""
        if self._dispatch is not None:
            self._dispatch.quiesce(self.config.step_timeout_s)

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Parameters and buffers with the keys of ``nn.Sequential(*stages).state_dict()``, or
        the model's own keys (``StateKeys``); whole tensors (under TP gathered by each TP group)."""
        return self.state_keys.merge(gather_state(self, "state_dict"))

    def load_state_dict(self, state_dict: dict) -> None:
        check_state_dict(self.state_keys.merge(gather_state(self, "state_shapes")), state_dict)  # no tensors move
        load_state(self, state_dict)  # whole tensors: each TP rank keeps its part (Note [tensor parallelism])
