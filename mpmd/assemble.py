"""What ``mpmd.Pipeline``'s constructor decides and starts: the arguments checked, TeraPipe's
token slices planned, ``schedule="auto"`` / ``num_microbatches="auto"`` planned and decided
again by trials on the actors (Note [calibrated auto] in ``mpmd/planning/replan.py``), and
the running ``Engine``."""

from __future__ import annotations

import dataclasses
import functools
import os
import statistics
import tempfile
import time
from typing import Any, Callable, NamedTuple, Optional

from actors.expert_setup import check_experts

from .planning import plan_pipeline
from .planning.replan import Trial, TrialLength, decide_on_actors, trial_at
from .profiler import calibrate_pipeline
from .runtime import Engine, PipelineConfig, build_schedule, check_microbatches, resolve_stages
from .runtime.cp import check_cp_pipeline
from .tensor_parallel import resolve_plans
from .terapipe import TokenSlicing, calibrate_token_slicing, plan_token_slicing, wants_token_slicing
from .training import checkpoint

__all__ = ["Assembled", "assemble"]


class Assembled(NamedTuple):
    engine: Engine  # started
    auto_decision: Any  # mpmd.planning's decision, when auto chose
    token_slicing: Optional[TokenSlicing]


def check_callables(loss_fn: Optional[Callable], optimizer: Optional[Callable],
                    lr_scheduler: Optional[Callable]) -> None:
    if loss_fn is not None and not callable(loss_fn):
        raise ValueError(f"loss_fn must be callable (output, target) -> scalar tensor, got {loss_fn!r}")
    if optimizer is not None and not callable(optimizer):
        raise ValueError("optimizer must be a factory: params -> torch.optim.Optimizer, "
                         "e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)")
    if lr_scheduler is not None and (not callable(lr_scheduler) or optimizer is None):
        raise ValueError("lr_scheduler must be a factory: optimizer -> LR scheduler, e.g. lambda opt: "
                         "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 100)); "
                         "it needs an optimizer")


def assemble(stages: Any, schedule: Any, num_microbatches: Any, loss_fn: Optional[Callable],
             optimizer: Optional[Callable], *, lr_scheduler: Optional[Callable], sample: Any, token_slices: Any,
             seq_len: Optional[int], slice_granularity: Optional[int], slice_overhead: Optional[float],
             options: dict) -> Assembled:
    """``mpmd.Pipeline(...)``'s work, with its arguments (``options``: its keyword options)."""
    check_callables(loss_fn, optimizer, lr_scheduler)
    sliced = wants_token_slicing(schedule, token_slices)
    if not sliced and (seq_len, slice_granularity, slice_overhead) != (None, None, None):
        raise ValueError("seq_len, slice_granularity and slice_overhead choose TeraPipe's token slices; pass "
                         "them with schedule='terapipe' (or token_slices=...), or leave them out")
    # Every option is checked here, before anything is measured or started.  The microbatch
    # count asked for (or "auto") is the schedule's to hold once built.
    microbatches = (1 if sliced else 4) if num_microbatches is None else num_microbatches
    check_microbatches(microbatches)
    config = PipelineConfig.from_options(**options)
    asked_dynamic = config.comm.dynamic_shapes  # what the user asked, before the token slices' own need
    auto_decision, token_slicing = None, None
    stages = resolve_stages(stages, config.recipe.seed)  # modules and/or factories (Note [stage factories])
    check_experts(enumerate(stages.modules), config.layout.ep, whole=True)  # before anything is measured
    check_cp_pipeline(stages.modules, config.layout, loss_fn, sliced=sliced, planned=(
        (isinstance(schedule, str) and schedule == "auto") or microbatches == "auto" or isinstance(config.layout.tp, tuple)))
    if sliced:
        token_slicing = plan_token_slicing(
            stages.modules, "terapipe" if schedule is None else schedule, microbatches,
            token_slices=token_slices, seq_len=seq_len, slice_granularity=slice_granularity,
            slice_overhead=slice_overhead, pp=config.layout.pp, device=config.cluster.device,
            num_cpus=config.cluster.num_cpus)
        microbatches = token_slicing.num_units  # each sequence is cut into slices, each a unit of the schedule
        config = dataclasses.replace(config, comm=dataclasses.replace(
            config.comm, dynamic_shapes=asked_dynamic or token_slicing.varies))
    schedule = "1f1b" if schedule is None else schedule
    if token_slicing is not None:
        schedule = token_slicing.schedule(len(stages))
        loss_fn = token_slicing.wrap_loss(loss_fn)
    trial = config.planning.auto_calibrate and loss_fn is not None  # auto decides again on the actors
    if token_slicing is None and ((isinstance(schedule, str) and schedule == "auto")
                                  or microbatches == "auto" or isinstance(config.layout.tp, tuple)):
        auto_decision = plan_pipeline(stages, schedule, config, sample, loss_fn, num_microbatches=microbatches,
                                      verbose=not trial, resolve_tp=functools.partial(
                                          resolve_plans, loss_parallel=config.layout.loss_parallel))

    def start(option=None) -> Engine:  # option: one of auto_decision's options, or None: the schedule given
        cfg = config if option is None else option.applied(config)
        built = build_schedule(schedule, len(stages), cfg, microbatches) if option is None else \
            build_schedule(option.schedule, len(stages), cfg, option.num_microbatches)
        layout = cfg.layout
        engine = Engine(stages, built, cfg, loss_fn=loss_fn, optimizer=optimizer,
                        lr_scheduler=lr_scheduler, batching=token_slicing,
                        tp_plans=resolve_plans(stages.modules, layout.tp_plan, layout.tp,
                                               loss_parallel=layout.loss_parallel))
        engine.start()
        return engine

    engine = start(auto_decision.chosen if auto_decision else None)
    if token_slicing is not None and token_slicing.calibrate:  # Note [calibrated slices]
        token_slicing = calibrate_token_slicing(engine, token_slicing, dynamic_shapes=asked_dynamic)
    if auto_decision is not None and trial:
        try:  # Note [calibrated auto]
            auto_decision, engine = decide_on_actors(
                auto_decision, engine, trial=lambda e: _trial(e, sample), make_engine=start, sweep=2,
                measure_at=lambda e, o: trial_at(e, o, lambda e: _trial(e, sample, restore=False)),
                dp=config.layout.dp, progress=lambda msg: print(msg, flush=True))
        except BaseException:
            engine.shutdown()
            raise
        print(auto_decision.table(), flush=True)
    return Assembled(engine, auto_decision, token_slicing)


def _trial(engine: Engine, sample: Any, restore: bool = True, length: TrialLength = TrialLength()) -> Trial:
    """Note [calibrated auto]: ``length``'s steps, then (``restore``) the state from before (a checkpoint)."""
    inputs, targets = sample
    with tempfile.TemporaryDirectory(prefix="mpmd-auto-trial-") as tmp:
        before = checkpoint.save_checkpoint(engine, os.path.join(tmp, "before")) if restore else None
        times = []
        while length.more_timed(times):
            t0 = time.perf_counter()
            engine.train_step(inputs, targets)
            times.append(time.perf_counter() - t0)
        step = statistics.median(times[length.warm:])
        costs = calibrate_pipeline(engine, inputs, targets, length.profiled_steps(step), None, True)
        if before is not None:
            checkpoint.load_checkpoint(engine, before)
    return Trial.of(costs, step, engine.schedule)
