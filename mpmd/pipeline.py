"""``mpmd.Pipeline``: the user API and the controller."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import ray
import torch

import schedules
from actors.program import encode_program
from schedules import Schedule

from . import _cluster
from . import _fit
from . import checkpoint as _ckpt
from ._checks import (check_inputs, check_state_dict, explain_stage_failure, finite_loss, nonfinite_loss_error,
                      record_inputs, warn_user)
from ._compile import compile_programs, forward_only, segments
from ._config import PipelineConfig
from ._data import concat_outputs, signature, split_batch
from ._dispatch import Dispatcher, PendingStep
from ._arguments import build_schedule as _build_schedule, check_stages as _check_stages, unpack_batch as _unpack
from .errors import StageFailedError

__all__ = ["Pipeline"]


class Pipeline:
    """Train a list of stage modules with a pipeline schedule on Ray actors.

    ``stages`` run in order; ``schedule`` is a registered name or a ``schedules.Schedule``.
    The resulting model equals ``nn.Sequential(*stages)`` trained with plain gradient
    accumulation over ``num_microbatches`` (times ``dp`` replicas).

    ``schedule="auto"`` and/or ``num_microbatches="auto"`` decide in the constructor,
    before any actor starts: the stages are timed on the controller on ``sample``, one
    step's batch ``(inputs, targets)`` (e.g. the first batch of the data), and every
    registered schedule (on ``num_actors``, or at its default stages per actor, so
    placements on fewer actors compete) and divisor of the per-replica batch is
    simulated; the fastest whose predicted peak memory fits ``memory_limit_bytes`` per
    actor (default: the device's memory) wins.  The decision table is printed and kept in
    ``pipe.auto_decision`` (see ``mpmd.auto``).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "Pipeline":
        # schedule="terapipe" or token_slices=... builds the token-sliced pipeline (mpmd/terapipe.py).
        if cls is Pipeline:
            from .terapipe import TokenSlicedPipeline, wants_token_slicing

            if wants_token_slicing(args, kwargs):
                cls = TokenSlicedPipeline
        return super().__new__(cls)

    def __init__(
        self,
        stages: Sequence[torch.nn.Module],
        schedule: Union[str, Schedule] = "1f1b",
        num_microbatches: Union[int, str] = 4,
        loss_fn: Optional[Callable] = None,
        optimizer: Optional[Callable] = None,
        *,
        sample: Any = None,
        **options: Any,
    ) -> None:
        self.config = PipelineConfig(num_microbatches=num_microbatches, **options)
        self._stages = _check_stages(stages)
        if loss_fn is not None and not callable(loss_fn):
            raise ValueError(f"loss_fn must be callable (output, target) -> scalar tensor, got {loss_fn!r}")
        if optimizer is not None and not callable(optimizer):
            raise ValueError("optimizer must be a factory: params -> torch.optim.Optimizer, "
                             "e.g. lambda params: torch.optim.AdamW(params, lr=1e-3)")
        self.loss_fn, self.optimizer_factory = loss_fn, optimizer
        self.auto_decision = None
        if (isinstance(schedule, str) and schedule == "auto") or self.config.num_microbatches == "auto":
            from .auto import plan_pipeline

            self.auto_decision = plan_pipeline(self._stages, schedule, self.config, sample, loss_fn)
            schedule = self.auto_decision.schedule
            self.config = dataclasses.replace(self.config, num_microbatches=self.auto_decision.num_microbatches)
        self.schedule = _build_schedule(schedule, len(self._stages), self.config)
        self._programs = {
            "train": compile_programs(schedules.lower(self.schedule, allreduce=self.config.dp > 1)),
            "forward": compile_programs(schedules.lower(forward_only(self.schedule))),
        }
        self._step_count = 0
        self.skipped_steps: list[int] = []  # steps whose non-finite loss was skipped (on_nan="skip")
        self._first_inputs = None  # structure, shapes and dtypes of the first step's inputs (mpmd/_checks.py)
        self._fill = None  # PipeFill manager, created by add_fill_job
        self._signatures: dict[str, tuple] = {}
        self.actors: list = []
        self._pg = None
        self._closed, self._dispatch = False, None
        self._start()

    # -- set-up ----------------------------------------------------------------------------------
    @property
    def num_ranks(self) -> int:
        return self.schedule.num_ranks

    def _start(self) -> None:
        cfg = self.config
        self._owns_ray = _cluster.connect(cfg.address, self.num_ranks * cfg.dp, cfg.num_cpus)
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise

    def _launch(self) -> None:
        cfg = self.config
        device = cfg.device
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) >= self.num_ranks * cfg.dp else "cpu"
        self.device = device
        num_gpus = cfg.num_gpus if cfg.num_gpus is not None else (1.0 if device == "cuda" else 0.0)
        self.actors, self._pg = _cluster.create_actors(
            num_ranks=self.num_ranks, dp=cfg.dp, device=device, num_cpus=cfg.num_cpus, num_gpus=num_gpus,
            placement=cfg.placement, seed=cfg.seed, ready_timeout_s=60.0)
        self._dispatch = Dispatcher(self.actors, self.schedule, cfg.dp, self._on_failure)
        address = self._dispatch.wait([self.actors[0].address.remote()], "start-up")[0]
        world = self.num_ranks * cfg.dp
        dp_groups = [[d * self.num_ranks + r for d in range(cfg.dp)] for r in range(self.num_ranks)]
        self._dispatch.wait([a.init_comm.remote(world_size=world, address=address,
                                                backend="nccl" if device == "cuda" else "gloo",
                                                timeout_s=cfg.comm_timeout_s, dp_groups=dp_groups)
                             for a in self.actors], "forming the communication groups")
        calls, owner = [], {}
        for i, actor in enumerate(self.actors):
            rank = i % self.num_ranks
            modules = {s: self._stages[s] for s in self.schedule.stages_of(rank)}
            calls.append(actor.setup.remote(modules=modules, optimizer=self.optimizer_factory, loss_fn=self.loss_fn,
                                            num_stages=self.schedule.num_stages,
                                            # per replica: the DP all-reduce averages the replicas' means
                                            num_microbatches=cfg.num_microbatches,
                                            bucket_bytes=cfg.bucket_bytes, skip_nonfinite=cfg.on_nan == "skip"))
            for name, progs in self._programs.items():
                calls.append(actor.set_program.remote(name, encode_program(progs[rank])))
            owner.update((c, i) for c in calls[len(owner):])
        self._dispatch.wait(calls, "shipping modules and programs", owner=owner)
        if cfg.step_channel:
            self._dispatch.open_channels()
        self._segments = {name: [segments(p, cfg.fusion) for p in progs] for name, progs in self._programs.items()}

    # -- training ----------------------------------------------------------------------------------
    def step(self, inputs: Any, targets: Any) -> float:
        """One optimizer step over ``num_microbatches`` microbatches (per replica); returns the mean loss."""
        if self.loss_fn is None:
            raise ValueError("step needs a loss_fn: Pipeline(..., loss_fn=torch.nn.functional.mse_loss)")
        if self._fill is not None and self._fill.active():
            loss = self._fill.step(inputs, targets)
            self._check_loss(loss, [loss])
            return loss
        result = self._run("train", inputs, targets)
        self._step_count += 1
        self._check_loss(result["loss"], [x for r in result["raw"] for x in r["losses"]])
        return result["loss"]

    def step_async(self, inputs: Any, targets: Any) -> PendingStep:
        """Issue one training step and return at once; ``.result()`` waits and gives its loss.

        Each actor runs its steps in issue order, so a step issued while the previous one
        runs starts the moment that one ends there: no dispatch or result latency between
        steps.  ``fit`` keeps one step in flight.  (With fill jobs running: synchronous.)"""
        if self.loss_fn is None:
            raise ValueError("step needs a loss_fn: Pipeline(..., loss_fn=torch.nn.functional.mse_loss)")
        if self._fill is not None and self._fill.active():
            return PendingStep(self, None, self.step(inputs, targets))
        pending = self._issue("train", inputs, targets)
        self._step_count += 1
        return PendingStep(self, pending, None)

    def _check_loss(self, loss: float, losses: list, step: Optional[int] = None) -> None:
        if finite_loss(loss, losses):
            return
        step = self._step_count - 1 if step is None else step
        if self.config.on_nan == "raise":
            raise nonfinite_loss_error(step, loss, losses)
        self.skipped_steps.append(step)  # the actors agreed not to step (StageWorker._finish)
        warn_user(f"step {step}: the loss is {loss}; skipped it (parameters and optimizer state unchanged)")

    def evaluate(self, inputs: Any, targets: Any) -> float:
        """Mean loss over the batch with a forward-only schedule; parameters unchanged."""
        if self.loss_fn is None:
            raise ValueError("evaluate needs a loss_fn: Pipeline(..., loss_fn=...)")
        return self._run("forward", inputs, targets)["loss"]

    def predict(self, inputs: Any) -> Any:
        """The last stage's output for ``inputs`` (forward-only schedule), joined along dim 0."""
        return self._run("forward", inputs, None, collect=True)["outputs"]

    def fit(self, data: Iterable, epochs: int = 1, progress: bool = True, *, checkpoint_dir: Optional[str] = None,
            checkpoint_every: Optional[int] = None, resume: bool = True, max_restarts: int = 0,
            keep_checkpoints: Optional[int] = 3) -> list[float]:
        """Train on an iterable of ``(inputs, targets)`` batches; returns the per-step losses.

        With ``checkpoint_dir``: a checkpoint ``step-N`` every ``checkpoint_every`` steps and at
        the end (the newest ``keep_checkpoints`` of this call are kept); ``resume=True`` first
        loads the newest complete one there and skips the batches it had consumed.
        ``max_restarts=k``: when an actor dies or a step times out, start fresh actors, load
        the last checkpoint and replay the batches since, up to ``k`` times.  Ctrl-C tears the
        actors down (an attached Ray keeps running).  See ``mpmd/checkpoint.py``.
        """
        opts = _fit.FitOptions(epochs=epochs, progress=progress, checkpoint_dir=checkpoint_dir,
                                checkpoint_every=checkpoint_every, resume=resume, max_restarts=max_restarts,
                                keep_checkpoints=keep_checkpoints)
        try:
            return _fit.fit_loop(self, data, _unpack, opts)
        except KeyboardInterrupt:
            self._abort()
            raise

    def _run(self, name: str, inputs: Any, targets: Any, collect: bool = False, profile: bool = False,
             fills: Optional[list] = None, while_waiting: Optional[Callable[[], None]] = None) -> dict:
        pending = self._issue(name, inputs, targets, collect=collect, profile=profile, fills=fills)
        if while_waiting is not None:
            while_waiting()
        return self._complete(pending)

    def _issue(self, name: str, inputs: Any, targets: Any, collect: bool = False, profile: bool = False,
               fills: Optional[list] = None) -> tuple:
        """Check and split the batch, issue the step's RPCs; ``_complete`` waits for them."""
        self._check_open()
        cfg = self.config
        parts = cfg.num_microbatches * cfg.dp
        hint = f"num_microbatches={cfg.num_microbatches} x dp={cfg.dp}"
        mb_in, mb_tg = self._microbatches(inputs, targets, parts, hint)
        got = record_inputs(mb_in[0])
        check_inputs(self._stages, self._first_inputs, got)
        sig = (signature(mb_in[0]), signature(mb_tg[0]) if mb_tg else ())
        relearn = cfg.dynamic_shapes or self._signatures.get(name) != sig
        issued = self._dispatch.issue_step(name, self._step_count, mb_in, mb_tg, relearn=relearn,
                                           segments=self._segments[name], collect=collect, profile=profile,
                                           fills=fills)
        return issued, name, sig, got, collect

    def _complete(self, pending: tuple) -> dict:
        issued, name, sig, got, collect = pending
        try:
            out = self._dispatch.finish_step(issued, self.config.step_timeout_s)
        except StageFailedError as e:
            raise explain_stage_failure(e, self._stages, got, self._first_inputs) from None
        except KeyboardInterrupt:
            self._abort()
            raise
        self._signatures[name] = sig
        if self._first_inputs is None:
            self._first_inputs = got
        result: dict = {}
        losses = [x for r in out for x in r["losses"]]
        if losses:
            result["loss"] = sum(losses) / len(losses)
        if collect:
            outs = [o for r in out for o in r.get("outputs", [])]
            result["outputs"] = self._join_outputs(outs)
        result["raw"] = out
        return result

    # Overridden by mpmd.terapipe.TokenSlicedPipeline, which cuts sequences into token slices.
    def _microbatches(self, inputs: Any, targets: Any, parts: int, hint: str) -> tuple[list, Optional[list]]:
        mb_in = split_batch(inputs, parts, "inputs", hint)
        mb_tg = split_batch(targets, parts, "targets", hint) if targets is not None else None
        return mb_in, mb_tg

    def _join_outputs(self, outputs: list) -> Any:
        return concat_outputs(outputs)

    @property
    def last_step_rpcs(self) -> int:
        """RPCs the controller issued for the last step (one per actor with ``fusion="step"``)."""
        return self._dispatch.last_rpcs

    def add_fill_job(self, job, policy: Union[str, Callable] = "fifo", margin: float = 0.2,
                     min_bubble_s: float = 0.002, refresh_every: int = 20, fetch_every: int = 8):
        """Run an independent ``mpmd.FillJob`` inside this pipeline's bubbles (PipeFill).

        The next training step is profiled to find the bubbles; later steps run chunks of
        the job's inputs there.  ``policy`` orders several jobs: "fifo", "sjf",
        "throughput" or a function of the list of jobs.  Outputs stay on the actors and
        come over every ``fetch_every`` steps (off the main job's path), when the job is
        done, on ``job.results()`` and on ``shutdown``.  Returns the job.
        """
        from ._fill_manager import FillManager

        self._check_open()
        if self._fill is None:
            self._fill = FillManager(self, policy=policy, margin=margin, min_bubble_s=min_bubble_s,
                                     refresh_every=refresh_every, fetch_every=fetch_every)
        return self._fill.add(job)

    def fill_summary(self) -> str:
        """A table of this pipeline's fill jobs: inputs done, busy seconds, cost per input, status."""
        return self._fill.summary() if self._fill is not None else "no fill jobs"

    def profile(self, inputs: Any, targets: Any, steps: int = 5):
        """Run ``steps`` training steps with timeline recording; returns a ``ProfileReport``."""
        from .profiler import profile_pipeline

        return profile_pipeline(self, inputs, targets, steps)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Parameters and buffers with exactly the keys of ``nn.Sequential(*stages).state_dict()``."""
        self._check_open()
        self._dispatch.quiesce(self.config.step_timeout_s)  # after the steps in flight, as Ray would order it
        per_rank = self._dispatch.wait([a.state_dict.remote() for a in self.actors[: self.num_ranks]], "state_dict")
        merged = {s: sd for part in per_rank for s, sd in part.items()}
        out = collections.OrderedDict()
        for s in range(self.schedule.num_stages):
            for k, v in merged[s].items():
                out[f"{s}.{k}"] = v
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        self._check_open()
        check_state_dict(self.state_dict(), state_dict)
        per_stage: dict[int, dict] = collections.defaultdict(dict)
        for key, value in state_dict.items():
            s, _, rest = key.partition(".")
            per_stage[int(s)][rest] = value
        calls = []
        for i, actor in enumerate(self.actors):
            rank = i % self.num_ranks
            calls.append(actor.load_state_dict.remote({s: per_stage[s] for s in self.schedule.stages_of(rank)}))
        self._dispatch.wait(calls, "load_state_dict")

    def save(self, path: str) -> str:
        """Write a checkpoint directory at ``path``: per stage the module and optimizer state, the
        step count, the actors' RNG states and the configuration; atomically (a crash mid-save
        leaves any previous checkpoint intact).  Returns the path.  See ``mpmd/checkpoint.py``."""
        return _ckpt.save_checkpoint(self, path)

    @_ckpt.class_or_instance_method
    def load(self_or_cls, path: str, **kwargs: Any) -> "Pipeline":
        """``pipe.load(path)`` restores this pipeline from a checkpoint (or the newest ``step-N``
        checkpoint under ``path``); ``mpmd.Pipeline.load(path, stages=..., loss_fn=..., optimizer=...,
        **options)`` builds a pipeline with the saved configuration, ``options`` overriding it (e.g.
        ``num_actors``: any layout of the same stage list), and restores it.  Returns the pipeline."""
        if isinstance(self_or_cls, type):
            if "stages" not in kwargs:
                raise ValueError("Pipeline.load(path, stages=[...]) needs the stage modules: a checkpoint holds "
                                 "their state, not their code")
            return _ckpt.new_pipeline_from_checkpoint(self_or_cls, path, **kwargs)
        if kwargs:
            raise ValueError(f"pipe.load(path) takes no options (got {sorted(kwargs)}); to change the configuration "
                             "build a new pipeline with mpmd.Pipeline.load(path, stages=..., **options)")
        _ckpt.load_checkpoint(self_or_cls, path)
        return self_or_cls

    # -- lifetime --------------------------------------------------------------------------------------
    def _restart(self) -> None:
        """A fresh set of actors after a failure (fit's ``max_restarts``); state comes from a checkpoint."""
        self._teardown(graceful=False)
        self._closed, self._signatures = False, {}
        try:
            self._launch()
            if self._fill is not None:
                self._fill.reattach()
        except BaseException:
            self.shutdown()
            raise

    def _abort(self) -> None:
        """Ctrl-C: kill the actors at once (a step may be mid-way); a Ray this pipeline started goes too."""
        self._on_failure()
        self.shutdown()

    def _on_failure(self) -> None:
        """An actor failed: tear every actor down so nothing waits on a dead peer."""
        self._teardown(graceful=False)

    def _teardown(self, *, graceful: bool) -> None:
        """Close the step channels and stop the actors; the pipeline is closed until a restart."""
        if self._dispatch is not None:
            self._dispatch.close()
        if self.actors or self._pg is not None:
            _cluster.teardown(self.actors, self._pg, graceful=graceful)
        self.actors, self._pg, self._closed = [], None, True

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this pipeline is shut down (after shutdown() or an actor failure); create a new one")

    def shutdown(self) -> None:
        """Stop the pipeline's actors.  A Ray this pipeline did not start keeps running."""
        if self._fill is not None and self.actors:
            self._fill.fetch()  # fill outputs still held by the actors
        self._teardown(graceful=True)
        if getattr(self, "_owns_ray", False) and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
