"""``mpmd.Pipeline``: the user API, a thin facade over the runtime engine and the features.

The constructor checks the arguments, lets the planning features decide what was left
to them (``schedule="auto"``, ``num_microbatches="auto"``, TeraPipe's token slices),
builds an ``Engine`` (``mpmd/runtime``) and starts it (``mpmd/assemble.py``).  Each method below is one call
into the engine or into a feature folder: training loop and checkpoints
(``mpmd/training``), the profiler (``mpmd/profiler``), PipeFill (``mpmd/pipefill``).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, Optional, Sequence, Union

import torch

from schedules import Costs, Schedule

from .assemble import assemble
from .pipefill import FillJob, FillManager
from .profiler import ProfileReport, calibrate_pipeline, profile_pipeline
from .runtime import FORWARD, PendingStep, PipelineConfig, build_stages, reuse_actors, stage_seed
from .training import checkpoint
from .training.fit import FitOptions, fit_loop
from .training.ray_data import fit_data

__all__ = ["Pipeline", "build_stages", "stage_seed", "reuse_actors"]


class Pipeline:
    """Train a list of stage modules with a pipeline schedule on Ray actors.

    ``stages`` run in order; ``schedule`` is a registered name or a ``schedules.Schedule``
    (default ``"1f1b"``).  The resulting model equals ``nn.Sequential(*stages)`` trained
    with plain gradient accumulation over ``num_microbatches`` (default 4) times ``dp``
    replicas.

    Each entry of ``stages`` is a module or a zero-argument factory returning one (mixed
    freely).  A factory is shipped instead of its module and every actor holding the stage
    builds it there, so the controller never holds the model, only its structure (built on
    the meta device).  Seed contract: stage ``s``'s factory runs under a fork of the random
    state after ``torch.manual_seed(mpmd.stage_seed(seed, s))``, ``seed`` being the ``seed``
    option (default 0), then moves to the actor's device; ``mpmd.build_stages(stages,
    seed=seed)`` builds the same modules on the controller, bit for bit.  Stages built by
    factories cannot share parameters (ties need modules).  Note [stage factories] in
    ``actors/build.py``.

    ``schedule="auto"`` and/or ``num_microbatches="auto"`` decide in the constructor: the
    stages are timed on the controller on ``sample``, one step's batch ``(inputs,
    targets)`` (e.g. the first batch of the data), and every registered schedule (on
    ``num_actors``, or at its default stages per actor, so placements on fewer actors
    compete) and divisor of the per-replica batch is simulated; the fastest whose
    predicted peak memory fits ``memory_limit_bytes`` per actor (default: the device's
    memory) is the provisional plan.  With ``auto_calibrate=True`` (the default; it needs a
    ``loss_fn``) the provisional plan then runs a short trial on its actors, every option
    is ranked again with what they measured, and a different winner runs a trial too: the
    plan measured faster trains.  The trials leave no trace (the state goes back to a
    checkpoint taken before them).  Note [calibrated auto] in ``mpmd/planning/replan.py``.
    The decision table is printed and kept in ``pipe.auto_decision``.

    ``schedule="terapipe"`` / ``"terapipe-1f1b"`` or ``token_slices=...`` trains with
    TeraPipe's token slices (``mpmd.terapipe``): ``num_microbatches`` (default 1) sequences
    per step, each cut into ``token_slices`` (``"auto"`` by default; a count, lengths or a
    cost function); ``seq_len``, ``slice_granularity`` and ``slice_overhead`` tune the
    choice.  ``"auto"`` without ``slice_overhead`` times a few slicings on the actors and
    plans with the per-slice overhead they measured; the probes leave no trace (Note
    [calibrated slices] in ``mpmd/terapipe/calibrate.py``).  ``pipe.token_slicing`` says
    what was chosen.
    """

    def __init__(
        self,
        stages: Sequence[Union[torch.nn.Module, Callable[[], torch.nn.Module]]],
        schedule: Union[str, Schedule, None] = None,
        num_microbatches: Union[int, str, None] = None,
        loss_fn: Optional[Callable] = None,
        optimizer: Optional[Callable] = None,
        *,
        lr_scheduler: Optional[Callable] = None,
        sample: Any = None,
        token_slices: Any = None,
        seq_len: Optional[int] = None,
        slice_granularity: Optional[int] = None,
        slice_overhead: Optional[float] = None,
        **options: Any,
    ) -> None:
        self.engine, self.auto_decision, self.token_slicing = assemble(
            stages, schedule, num_microbatches, loss_fn, optimizer, lr_scheduler=lr_scheduler, sample=sample,
            token_slices=token_slices, seq_len=seq_len, slice_granularity=slice_granularity,
            slice_overhead=slice_overhead, options=options)
        self.fill_manager: Optional[FillManager] = None  # created by add_fill_job

    # -- what the engine runs ------------------------------------------------------------------
    @property
    def config(self) -> PipelineConfig:
        """The options, one group per concern (``config.layout.dp``, ``config.cluster.device``, ...);
        the microbatch count is the schedule's (``pipe.schedule.num_microbatches``)."""
        return self.engine.config

    @property
    def schedule(self) -> Schedule:
        return self.engine.schedule

    @property
    def num_ranks(self) -> int:
        return self.engine.num_ranks

    @property
    def device(self) -> Optional[str]:
        return self.engine.fleet.device

    @property
    def actors(self) -> list:
        """Ray actor handles in grid order: replica, then rank, then TP rank (Note [device grid])."""
        return self.engine.fleet.actors

    @property
    def loss_fn(self) -> Optional[Callable]:
        return self.engine.loss_fn

    @property
    def skipped_steps(self) -> list[int]:  # steps whose non-finite loss was skipped (on_nan="skip")
        return self.engine.skipped_steps

    @property
    def moe_metrics(self) -> dict:
        """The last training step's MoE metrics, ``{name: value}``: per MoE block (names prefixed
        with the stage) the tokens each expert got (``.load``, summed over the replicas and
        microbatches), the mean auxiliary loss (``.aux``) and the router's bias (``.bias``);
        empty without MoE blocks (docs/moe.md)."""
        return self.engine.moe_metrics

    @property
    def last_step_rpcs(self) -> int:
        """RPCs the controller issued for the last step (one per actor with ``fusion="step"``)."""
        return self.engine.last_dispatch.rpcs

    # -- training --------------------------------------------------------------------------------
    def step(self, inputs: Any, targets: Any, **side: Any) -> float:
        """One optimizer step over ``num_microbatches`` microbatches (per replica); returns the mean loss.

        ``side``: side inputs by name (an attention mask, position ids, a loss mask): each goes,
        cut into microbatches like the inputs when its first dimension is the batch size, to
        the stages whose ``forward`` (and to ``loss_fn`` when it) takes that keyword
        (``mpmd/runtime/side.py``)."""
        return self.step_async(inputs, targets, **side).result()

    def step_async(self, inputs: Any, targets: Any, **side: Any) -> PendingStep:
        """Issue one training step and return at once; ``.result()`` waits and gives its loss.

        Each actor runs its steps in issue order, so a step issued while the previous one
        runs starts the moment that one ends there: no dispatch or result latency between
        steps.  ``fit`` keeps one step in flight.  (With fill jobs running: synchronous.)"""
        checkpoint.raise_failed_save(self.engine)  # an asynchronous save that failed (Note [asynchronous save])
        if self.fill_manager is not None and self.fill_manager.active():
            if self.engine.loss_fn is None:
                raise ValueError("step needs a loss_fn: Pipeline(..., loss_fn=torch.nn.functional.mse_loss)")
            return PendingStep.finished(self.fill_manager.step(inputs, targets, side))
        return self.engine.train_step_async(inputs, targets, side=side)

    def evaluate(self, inputs: Any, targets: Any, **side: Any) -> float:
        """Mean loss over the batch with a forward-only schedule; parameters unchanged."""
        if self.engine.loss_fn is None:
            raise ValueError("evaluate needs a loss_fn: Pipeline(..., loss_fn=...)")
        return self.engine.run(FORWARD, inputs, targets, side=side).loss

    def predict(self, inputs: Any, **side: Any) -> Any:
        """The last stage's output for ``inputs`` (forward-only schedule), joined along dim 0."""
        return self.engine.run(FORWARD, inputs, None, side=side, collect=True).outputs

    def fit(self, data: Iterable, epochs: int = 1, progress: bool = True, *, checkpoint_dir: Optional[str] = None,
            checkpoint_every: Optional[int] = None, resume: bool = True, max_restarts: int = 0,
            keep_checkpoints: Optional[int] = 3, callbacks: Sequence[Any] = (), log_every: int = 10,
            tokens_per_sample: Optional[int] = None, checkpoint_async: bool = False, batch_size: Optional[int] = None,
            columns: Sequence[str] = ("inputs", "targets")) -> list[float]:
        """Train on an iterable of ``(inputs, targets)`` or ``(inputs, targets, side)`` batches
        (``side``: a dict of side inputs, as ``step`` takes them), or on a ``ray.data.Dataset``
        whose rows hold the ``columns`` (input column, target column), ``batch_size`` rows a step:
        the actors of the first and last stages pull them from ``streaming_split`` iterators
        themselves, each replica its own (``mpmd/training/ray_data.py``); returns the per-step losses, a
        ``mpmd.training.FitHistory``: a list of the losses that also holds each step's record
        (``.records``, ``.grad_norms``, ``.lrs``).

        ``callbacks``: each gets a record per completed step (``step``, ``loss``, ``grad_norm``,
        ``lr``, ``skipped``, ``samples``, ``step_time_s``, ``samples_per_s``, ``tokens_per_s``):
        a function of the record, or an object with ``on_step(record)`` (every step),
        ``on_log(record)`` (every ``log_every``-th step and the last), ``on_end()`` (at the end,
        also when fit raises); ``mpmd.training.CSVLogger(path)`` and ``TensorBoardLogger(log_dir)``
        write the logged steps.  A callback that raises stops fit with its exception (after every
        ``on_end``).  ``tokens_per_sample`` (the sequence length) gives ``tokens_per_s``.
        ``progress``: a tqdm bar on a terminal, else a plain line every ``log_every`` steps;
        False prints nothing.

        With ``checkpoint_dir``: a checkpoint ``step-N`` every ``checkpoint_every`` steps and at
        the end (the newest ``keep_checkpoints`` of this call are kept); ``resume=True`` first
        loads the newest complete one there and skips the batches it had consumed.
        ``max_restarts=k``: when an actor dies or a step times out, start fresh actors, load
        the last checkpoint and replay the batches since, up to ``k`` times.  Ctrl-C tears the
        actors down (an attached Ray keeps running).  ``checkpoint_async=True``: the periodic
        checkpoints are written while training goes on (``save(blocking=False)``); a restart
        goes back to the last *complete* one, and fit returns with every checkpoint complete
        (a failed one raises at the next step or at the end).  See ``mpmd/training``.
        """
        opts = FitOptions(epochs=epochs, progress=progress, checkpoint_dir=checkpoint_dir,
                          checkpoint_every=checkpoint_every, resume=resume, max_restarts=max_restarts,
                          keep_checkpoints=keep_checkpoints, callbacks=callbacks, log_every=log_every,
                          tokens_per_sample=tokens_per_sample, checkpoint_async=checkpoint_async)
        data = fit_data(self.engine, data, batch_size=batch_size, columns=columns, max_restarts=max_restarts,
                        filling=self.fill_manager is not None and self.fill_manager.active())
        try:
            return fit_loop(self.engine, self.step_async, data, opts)
        except KeyboardInterrupt:
            self.engine.fleet.abort()
            raise

    # -- features ----------------------------------------------------------------------------------
    def add_fill_job(self, job: FillJob, policy: Union[str, Callable] = "fifo", margin: float = 0.2,
                     min_bubble_s: float = 0.002, refresh_every: int = 20, fetch_every: int = 8) -> FillJob:
        """Run an independent ``mpmd.FillJob`` inside this pipeline's bubbles (PipeFill).

        The next training step is profiled to find the bubbles; later steps run chunks of
        the job's inputs there.  ``policy`` orders several jobs: "fifo", "sjf",
        "throughput" or a function of the list of jobs.  Outputs stay on the actors and
        come over every ``fetch_every`` steps (off the main job's path), when the job is
        done, on ``job.results()`` and on ``shutdown``.  Returns the job.
        """
        self.engine.fleet.check_open()
        if self.fill_manager is None:
            self.fill_manager = FillManager(self.engine, policy=policy, margin=margin, min_bubble_s=min_bubble_s,
                                            refresh_every=refresh_every, fetch_every=fetch_every)
        return self.fill_manager.add(job)

    def fill_summary(self) -> str:
        """A table of this pipeline's fill jobs: inputs done, busy seconds, cost per input, status."""
        return self.fill_manager.summary() if self.fill_manager is not None else "no fill jobs"

    def profile(self, inputs: Any, targets: Any, steps: int = 5) -> ProfileReport:
        """Run ``steps`` training steps with timeline recording; returns a ``ProfileReport``."""
        return profile_pipeline(self.engine, inputs, targets, steps)

    def calibrate(self, inputs: Any, targets: Any, steps: int = 4,
                  activation_bytes: Union[float, Sequence[float], None] = None, probe: bool = True) -> Costs:
        """The cost model measured on these actors (Note [runtime costs] in schedules/costs.py):
        per stage F, B/I, W, the optimizer step per rank, the fixed cost of a task and of a
        message, per pair of ranks the message latency, the step's own overhead.  It runs
        ``steps`` profiled training steps (they update the parameters) after 2 ordinary ones.
        ``activation_bytes`` (per stage, its output's bytes; default: as the actors sent them)
        sizes the transfers.  ``probe``: each pair's latency and bandwidth from ping-pongs of
        4 KiB to 4 MiB between the actors (``mpmd.profiler.probe_links``) instead of from
        the steps' own messages (which have one size, so all latency).
        ``schedules.simulate(pipe.engine.lower_train(), costs).step_time`` predicts a step."""
        return calibrate_pipeline(self.engine, inputs, targets, steps, activation_bytes, probe)

    # -- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> "collections.OrderedDict[str, torch.Tensor]":
        """Parameters and buffers with exactly the keys of ``nn.Sequential(*stages).state_dict()``.
        This gathers the whole model on the controller (each stage once: under TP its TP group
        gathers each tensor in turn and TP rank 0 sends it); to keep or move weights at scale use
        ``save``/``load``, which never leave the actors."""
        return self.engine.state_dict()

    def export_safetensors(self, directory: str, *, dtype: Optional[str] = None, skip=()) -> dict:
        """Write the weights into ``directory`` as sharded safetensors with
        ``model.safetensors.index.json``, under ``state_dict``'s keys, the actors writing the
        files (Note [export from the actors] in mpmd/training/export.py): the controller holds
        none of them.  ``dtype``: e.g. ``"bfloat16"``; ``skip``: keys left out.  The index's
        weight map (key -> file)."""
        from .training.export import export_safetensors

        return export_safetensors(self.engine, str(directory), skip=skip, dtype=dtype)

    def load_safetensors(self, directory: str) -> None:
        """Load pretrained weights from a safetensors model directory (``save_pretrained``'s, or
        ``export_safetensors``'s), the actors reading each its own part: under TP only its shard's
        bytes (Note [weights from safetensors] in mpmd/training/export.py).  The keys are
        ``state_dict``'s (a Hugging Face model split by ``mpmd.split`` keeps the model's own)."""
        from .training.export import load_safetensors

        load_safetensors(self.engine, str(directory))

    def load_state_dict(self, state_dict: dict) -> None:
        """Whole tensors, checked against the shapes the actors report; each stage's part goes
        into Ray's object store once and each actor keeps its part of it."""
        self.engine.fleet.check_open()
        self.engine.load_state_dict(state_dict)

    def save(self, path: str, *, blocking: bool = True) -> Union[str, checkpoint.PendingSave]:
        """Write a checkpoint directory at ``path``: per stage the module, optimizer and scheduler
        state, the step count, the actors' RNG states and the configuration; atomically (a crash
        or a failed write mid-save leaves any previous checkpoint intact; a failed write raises
        ``mpmd.training.CheckpointError`` naming the actor and the stage).  Each actor writes its
        own stages' files, all at once, so ``path`` must be reachable from every actor (one node,
        or a shared filesystem).  Returns the path.

        ``blocking=False`` returns a ``mpmd.training.PendingSave`` as soon as the actors hold a
        copy of their state (after the steps issued so far): they write it while training goes
        on, and the checkpoint appears, whole, once written (``.result()`` waits and gives the
        path).  One save is in flight at a time; a failure is raised by ``.result()``, else by
        the next step, save or load.  See ``mpmd/training/checkpoint.py``."""
        return checkpoint.save_checkpoint(self.engine, path, blocking=blocking)

    @checkpoint.class_or_instance_method
    def load(self_or_cls, path: str, **kwargs: Any) -> "Pipeline":
        """``pipe.load(path)`` restores this pipeline from a checkpoint (or the newest ``step-N``
        checkpoint under ``path``); ``mpmd.Pipeline.load(path, stages=..., loss_fn=..., optimizer=...,
        **options)`` builds a pipeline with the saved configuration, ``options`` overriding it (e.g.
        ``num_actors``: any layout of the same stage list), and restores it.  Returns the pipeline."""
        if isinstance(self_or_cls, type):
            if "stages" not in kwargs:
                raise ValueError("Pipeline.load(path, stages=[...]) needs the stages (modules or factories): a "
                                 "checkpoint holds their state, not their code")
            stages = kwargs.pop("stages")
            path, options = checkpoint.checkpoint_arguments(path, kwargs)
            pipe = self_or_cls(stages, **options)
            try:
                checkpoint.load_checkpoint(pipe.engine, path)
            except BaseException:
                pipe.shutdown()
                raise
            return pipe
        if kwargs:
            raise ValueError(f"pipe.load(path) takes no options (got {sorted(kwargs)}); to change the configuration "
                             "build a new pipeline with mpmd.Pipeline.load(path, stages=..., **options)")
        checkpoint.load_checkpoint(self_or_cls.engine, path)
        return self_or_cls

    # -- lifetime --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop the pipeline's actors, once an asynchronous save in flight is complete (its
        failure raised).  A Ray this pipeline did not start keeps running."""
        try:
            if not self.engine.fleet.closed:
                checkpoint.finish_saves(self.engine)
        finally:
            if self.fill_manager is not None and not self.engine.fleet.closed:
                self.fill_manager.fetch()  # fill outputs still held by the actors
            self.engine.shutdown()

    def __enter__(self) -> "Pipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
