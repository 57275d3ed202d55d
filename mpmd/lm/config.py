"""The configuration of ``mpmd train``: one typed, frozen dataclass per TOML section, each
value checked in ``__post_init__``, and ``TrainConfig`` checking what crosses sections
(the batch against microbatches x dp, ``seq_len`` against the model's positions, the
data files) -- all before anything starts.  Reading TOML and ``--set`` overrides, with
unknown keys refused naming the valid ones near them, is in ``config_io.py``."""

from __future__ import annotations

import dataclasses
import glob
import os
from typing import ClassVar, Optional, Union

from ..runtime.limits import (MAX_ACTORS, MAX_MEMORY_BYTES, MAX_MICROBATCHES, MAX_SEED, MAX_TIMEOUT_S, FloatRange,
                              IntRange)
from .limits import (MAX_BATCH_SIZE, MAX_HEADS, MAX_LAYERS, MAX_MB, MAX_PEAK_FLOPS, MAX_POSITIONS, MAX_STEPS,
                     MAX_VOCAB, MAX_WORKERS, ONE_BYTE_MB, POSITIVE, STEPS, STEPS_OR_0, check_choice, check_values,
                     config_section)
from .model_config import MODEL_SIZES, MOE_FAMILIES, ModelConfig

__all__ = ["ModelConfig", "TokenizerConfig", "DataConfig", "OptimConfig", "ParallelConfig", "RunConfig",
           "TrainConfig", "MODEL_SIZES", "SCHEDULE_AUTO", "LAYER_SPLITS", "DEFAULT_STEP_TIMEOUT_S"]

SCHEDULE_AUTO = "auto"
LAYER_SPLITS = ("equal", "balanced")  # parallel.layers's names (Note [balanced layers] in mpmd/lm/plan.py)

_FORMATS = ("auto", "text", "jsonl", "parquet")
_DECAYS = ("cosine", "linear", "constant")
_PRECISIONS = ("fp32", "bf16", "fp16")
_DEVICES = ("auto", "cpu", "cuda")

# ``mpmd train``'s default step timeout (parallel.step_timeout_s): Note [train's step timeout].
DEFAULT_STEP_TIMEOUT_S = 600.0

# Note [train's step timeout]
# The controller waits at most ``step_timeout_s`` for each step, then tears the actors down
# with a PipelineTimeoutError naming the step.  Without it a peer hung inside a dp collective
# stalls the run until the collective's own timeout: 10 min on NCCL (and then a dead actor,
# not an error naming the step), 30 min on gloo.  The controller gives every step the same
# time (mpmd/runtime/dispatch.py: no allowance for the first), so the default must cover the
# first step, which connects the NCCL pairs and compiles (parallel.compile): 600 s is 2x the
# allowance the actors themselves give a first step's waits (FIRST_STEP_S = 300 s in
# actors/comm.py), 20x the ~30 s the debug model's regional compile took, and 250x the 8B
# config's predicted 2.4 s step.  0 turns it off (a step that legitimately takes longer: a
# large model on CPUs).


@config_section
class TokenizerConfig:
    """``path``: a tokenizer.json to use; else a byte-level BPE of ``vocab_size`` is trained on
    the training files (and saved with the run)."""

    path: Optional[str] = None  # a tokenizer.json; None: train a byte-level BPE
    vocab_size: int = 512  # the BPE's vocabulary, EOS included (>= 259)
    min_frequency: int = 2  # the BPE's least frequency for a merge
    sample_mb: float = 16.0  # the BPE is trained on at most this much text, taken evenly over the corpus

    LIMITS: ClassVar[dict] = dict(
        vocab_size=IntRange(259, MAX_VOCAB, "8x the largest vocabularies in use (MAX_VOCAB)"),  # 256 bytes, EOS, ...
        # a pair occurs at most once per byte of the sample
        min_frequency=IntRange(1, int(MAX_MB * 2 ** 20), "the largest sample's bytes (MAX_MB)"),
        sample_mb=FloatRange(ONE_BYTE_MB, MAX_MB, why="the sample is held in the controller's memory (MAX_MB)"),
    )

    def __post_init__(self) -> None:
        check_values("tokenizer", self)
        if self.path is not None and not os.path.isfile(self.path):
            raise ValueError(f"tokenizer.path = {self.path!r}: no such file (give a tokenizer.json, or leave "
                             f"tokenizer.path out to train a byte-level BPE on the training files)")


@config_section
class DataConfig:
    """``train_files``: paths or globs of .txt / .jsonl / .parquet (``format`` auto by extension);
    ``"builtin:debug"`` is the text the package ships.  They are tokenized once into
    ``prepared_dir`` (default: RUN_DIR/prepared; across nodes, a filesystem every node
    mounts) by ``workers`` Ray Data workers, each taking ``chunk_mb`` of text at a time
    (``mpmd prepare-data``, Note [prepared data]).  ``val_fraction`` of the packed
    sequences is held out for validation, rounded to whole batches: at least one, at most
    ``run.eval_batches``."""

    train_files: tuple[str, ...] = ("builtin:debug",)  # paths or globs; "builtin:debug": the text the package ships
    format: str = "auto"  # "auto" (by extension), "text", "jsonl", "parquet"
    text_key: str = "text"  # the document column of jsonl and parquet rows
    seq_len: int = 64  # tokens per sequence
    val_fraction: float = 0.1  # of the sequences held out for validation (whole batches, at most run.eval_batches)
    shuffle_seed: int = 0  # the order of the sequences (Note [data order])
    prepared_dir: Optional[str] = None  # None: RUN_DIR/prepared
    workers: Optional[int] = None  # Ray Data tokenizing workers; None: the cluster's CPUs, at most 8
    chunk_mb: float = 16.0  # text per unit of work
    # attention within each packed document, positions restarting after each EOS (docs/context.md)
    document_mask: bool = False  # keep attention within each document of a packed sequence

    LIMITS: ClassVar[dict] = dict(
        seq_len=IntRange(1, MAX_POSITIONS, "8x Llama 3.1's context (MAX_POSITIONS)"),
        val_fraction=FloatRange(0.0, 1.0, low_open=True, high_open=True),
        shuffle_seed=IntRange(0, MAX_SEED, "numpy's seeds (MAX_SEED)"),
        workers=IntRange(1, MAX_WORKERS, "Ray Data tasks at a time (MAX_WORKERS)", optional=True),
        chunk_mb=FloatRange(ONE_BYTE_MB, MAX_MB, why="a unit of work is held in a worker's memory (MAX_MB)"),
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "train_files", tuple(self.train_files))
        check_values("data", self)
        if not self.train_files:
            raise ValueError("data.train_files is empty: give at least one file (or \"builtin:debug\")")
        check_choice("data", "format", self.format, _FORMATS)
        self.files()  # every file exists

    def files(self) -> tuple[str, ...]:
        """The training files, globs expanded (sorted), in the order given."""
        out = []
        for pattern in self.train_files:
            if pattern.startswith("builtin:"):
                out.append(pattern)
                continue
            found = sorted(glob.glob(os.path.expanduser(pattern)))
            if not found:
                raise ValueError(f"data.train_files: {pattern!r} matches no file (cwd {os.getcwd()}); give "
                                 f"existing .txt / .jsonl / .parquet files or globs")
            out.extend(found)
        return tuple(out)


@config_section
class OptimConfig:
    """AdamW with warm-up then ``decay`` to ``min_lr_ratio * lr`` at ``steps``."""

    steps: int = 100  # optimizer steps (the LR schedule's length)
    batch_size: int = 16  # sequences per optimizer step, all replicas together
    lr: float = 3e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # the LR decays to lr * this at optim.steps
    warmup_steps: int = 10  # linear warm-up steps
    decay: str = "cosine"  # "cosine", "linear" or "constant"
    weight_decay: float = 0.1  # AdamW's, not on norms and biases
    beta1: float = 0.9  # AdamW's betas
    beta2: float = 0.95  # AdamW's betas
    eps: float = 1e-8  # AdamW's epsilon
    clip_grad_norm: float = 1.0  # 0: no clipping
    seed: int = 0  # the weights' initialisation
    moe_aux_loss_coef: float = 0.0  # MoE: the load-balancing loss's weight per layer (Qwen3-MoE: 0.001); 0: none
    moe_bias_update_rate: float = 0.0  # MoE: the router bias's step per optimizer step (DeepSeek-V3: 0.001); 0: none

    LIMITS: ClassVar[dict] = dict(
        steps=IntRange(1, MAX_STEPS, "100x the longest runs reported (MAX_STEPS)"),
        batch_size=IntRange(1, MAX_BATCH_SIZE, "512x Llama 3 405B's 2,048 sequences (MAX_BATCH_SIZE)"),
        lr=POSITIVE,
        min_lr_ratio=FloatRange(0.0, 1.0),
        warmup_steps=STEPS_OR_0,
        weight_decay=FloatRange(0.0),
        beta1=FloatRange(0.0, 1.0, high_open=True),
        beta2=FloatRange(0.0, 1.0, high_open=True),
        eps=POSITIVE,
        clip_grad_norm=FloatRange(0.0),  # 0: no clipping
        seed=IntRange(0, MAX_SEED, "numpy's seeds; torch.manual_seed takes seed x 1,000,003 + stage (MAX_SEED)"),
        moe_aux_loss_coef=FloatRange(0.0),
        moe_bias_update_rate=FloatRange(0.0),
    )

    def __post_init__(self) -> None:
        check_values("optim", self)
        check_choice("optim", "decay", self.decay, _DECAYS)
        if self.warmup_steps > self.steps:
            raise ValueError(f"optim.warmup_steps ({self.warmup_steps}) is more than optim.steps ({self.steps})")


@config_section
class ParallelConfig:
    """The pipeline: ``stages``, ``layers`` (decoder layers per stage: Note [balanced layers] in
    mpmd/lm/plan.py), ``actors`` (default: the schedule's), ``schedule`` (a name or "auto"),
    ``microbatches`` per replica, ``dp``, ``zero``, ``tp`` (tensor parallelism inside each stage:
    ``Pipeline(tp=..., tp_plan="auto")``), ``cp`` (context parallelism: each sequence sharded
    over ``cp`` actors of a stage, docs/context.md)."""

    stages: int = 2  # pipeline stages
    # "equal": the same number of decoder layers per stage; "balanced": the counts the simulator
    # predicts fastest for the schedule within memory_limit_gb (the head's FLOPs counted); or a list.
    layers: Union[str, tuple[int, ...]] = "equal"  # decoder layers per stage: "equal", "balanced" or a list
    actors: Optional[int] = None  # pipeline actors per replica; None: the schedule's
    schedule: str = "1f1b"  # a schedule name or "auto"
    microbatches: int = 4  # microbatches per replica and step
    dp: int = 1  # data-parallel replicas
    zero: int = 0  # 1: ZeRO-1, the optimizer state split over the dp replicas
    tp: int = 1  # actors per stage, each stage sharded over them with the built-in plan (tp_plan="auto")
    cp: int = 1  # context parallelism: each sequence sharded over this many actors of a stage (Pipeline(cp=...))
    ep: int = 1  # expert parallelism: a MoE stage's experts split over this many of its dp x cp actors (divides dp x cp)
    # one microbatch's forward and another's backward overlapped on an actor, hiding the experts' all-to-alls:
    # "auto" (dualpipev at ep > 1), true (a schedule with pairs: dualpipev) or false (docs/overlap.md)
    overlap: Union[str, bool] = "auto"  # Pipeline(overlap=...): "auto", true or false
    precision: str = "fp32"  # "fp32", "bf16" or "fp16" (with loss scaling)
    recompute: bool = False  # recompute each stage's forward in its backward (activation checkpointing)
    compile: bool = False  # torch.compile of each decoder layer on the actors (regional)
    compile_backend: str = "inductor"  # torch.compile's backend
    device: str = "cpu"  # "cpu", "cuda" or "auto"
    memory_limit_gb: Optional[float] = None  # per actor, for auto and the dry run; None: the device's
    # Note [train's step timeout] (above): a hung step becomes an error naming it, not a stall
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S  # the most a step may take, in seconds; 0: no limit

    LIMITS: ClassVar[dict] = dict(
        stages=IntRange(1, MAX_LAYERS, "each stage holds a decoder layer (MAX_LAYERS)"),
        actors=IntRange(1, MAX_LAYERS, "each actor holds a stage (MAX_LAYERS)", optional=True),
        microbatches=IntRange(1, MAX_MICROBATCHES, "the schedule lists every microbatch's actions and is built "
                                                   "before the first step (MAX_MICROBATCHES); use fewer, larger "
                                                   "microbatches"),
        dp=IntRange(1, MAX_ACTORS, "data-parallel replicas (MAX_ACTORS)"),
        zero=IntRange(0, 1, "0 (off) or 1 (ZeRO-1, the optimizer state split over the dp replicas)"),
        tp=IntRange(1, MAX_HEADS, "each tensor-parallel actor holds one attention head at least (MAX_HEADS)"),
        ep=IntRange(1, MAX_ACTORS, "expert-parallel ranks are dp replicas (MAX_ACTORS)"),
        cp=IntRange(1, MAX_ACTORS, "the actors a stage's sequence is sharded over (MAX_ACTORS)"),
        memory_limit_gb=FloatRange(0.0, MAX_MEMORY_BYTES / 2 ** 30, low_open=True, optional=True,
                                   why="1 PiB per actor (MAX_MEMORY_BYTES)"),
        step_timeout_s=FloatRange(0.0, MAX_TIMEOUT_S, why="a week (MAX_TIMEOUT_S) is no limit in effect; 0: none"),
    )

    def __post_init__(self) -> None:
        check_values("parallel", self)
        if isinstance(self.layers, list):
            object.__setattr__(self, "layers", tuple(self.layers))
        if isinstance(self.layers, str):
            check_choice("parallel", "layers", self.layers, LAYER_SPLITS)
        elif not isinstance(self.layers, tuple) or not all(isinstance(n, int) and not isinstance(n, bool)
                                                           for n in self.layers):
            raise ValueError(f"parallel.layers must be \"equal\", \"balanced\" or a list of integers, got "
                             f"{self.layers!r}")
        elif len(self.layers) != self.stages or min(self.layers) < 1:
            raise ValueError(f"parallel.layers = {list(self.layers)} must give each of the {self.stages} stages "
                             f"(parallel.stages) at least one decoder layer, or be \"equal\" or \"balanced\"")
        if self.layers == "balanced" and self.schedule == SCHEDULE_AUTO:
            raise ValueError("parallel.layers = \"balanced\" balances the layers for one schedule, but "
                             "parallel.schedule is \"auto\": name the schedule (the dry run's auto table ranks "
                             "them), or use layers = \"equal\"")
        devices = self.stages * self.dp * self.tp * self.cp
        if devices > MAX_ACTORS:
            names, sizes = "stages x dp x tp" + (" x cp" if self.cp > 1 else ""), [self.stages, self.dp, self.tp] + (
                [self.cp] if self.cp > 1 else [])
            raise ValueError(f"parallel.{names} = {' x '.join(map(str, sizes))} = {devices:,} actors is more than the "
                             f"maximum {MAX_ACTORS:,} (MAX_ACTORS)")
        if self.zero and self.dp < 2:
            raise ValueError("parallel.zero = 1 splits the optimizer state over the dp replicas, but parallel.dp is "
                             "1: set parallel.dp >= 2, or zero = 0")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"parallel.ep ({self.ep}) must divide parallel.dp ({self.dp}) x parallel.cp ({self.cp}): "
                             f"the expert-parallel ranks are a stage's data- and context-parallel actors (docs/moe.md); "
                             f"raise dp or lower ep")
        self._check_overlap()
        check_choice("parallel", "precision", self.precision, _PRECISIONS)
        check_choice("parallel", "device", self.device, _DEVICES)
        if self.compile:
            import torch

            backends = torch.compiler.list_backends(exclude_tags=())
            check_choice("parallel", "compile_backend", self.compile_backend, backends)
        if self.schedule != SCHEDULE_AUTO:
            import schedules

            try:
                schedules.schedule_info(self.schedule)
            except ValueError as e:
                raise ValueError(f"parallel.schedule: {e}") from None


    def _check_overlap(self) -> None:
        if not (self.overlap == "auto" or isinstance(self.overlap, bool)):
            raise ValueError(f"parallel.overlap must be \"auto\", true or false, got {self.overlap!r}")
        import schedules

        paired = [n for n in schedules.schedule_names() if schedules.schedule_info(n).overlapped is not None]
        if self.overlap is True and self.schedule not in (SCHEDULE_AUTO, *paired):
            raise ValueError(f"parallel.overlap = true runs a schedule's forward-backward pairs overlapped, but "
                             f"parallel.schedule = {self.schedule!r} has none; use schedule = "
                             f"{' or '.join(map(repr, paired))}, or overlap = \"auto\" or false")


@config_section
class RunConfig:
    """Where the run lives and what it writes: checkpoints every ``checkpoint_every`` steps
    keeping ``keep_checkpoints``, validation every ``eval_every`` steps, metrics, the export."""

    dir: str = "runs/debug"  # the run's directory: config, tokenizer, prepared data, checkpoints, metrics, export
    checkpoint_every: int = 50  # 0: no checkpoints
    keep_checkpoints: int = 2  # checkpoints kept (the newest)
    resume: bool = True  # continue from the newest checkpoint in run.dir
    eval_every: int = 25  # validation every this many steps
    eval_batches: int = 2  # validation batches
    log_every: int = 10  # a metrics line every this many steps
    tensorboard: bool = True  # TensorBoard events in run.dir/tensorboard
    csv: bool = True  # run.dir/metrics.csv
    progress: bool = True  # a progress bar (a plain line per log_every in a log file)
    export: bool = True  # a Hugging Face model in run.dir/hf at the end
    peak_flops: Optional[float] = None  # per actor (device), FLOP/s; None: the table or a measured matmul
    stop_after: Optional[int] = None  # stop at this step (an interruption: the schedule still runs to optim.steps)

    LIMITS: ClassVar[dict] = dict(
        checkpoint_every=STEPS_OR_0,
        keep_checkpoints=STEPS,
        eval_every=STEPS,
        eval_batches=STEPS,
        log_every=STEPS,
        peak_flops=FloatRange(0.0, MAX_PEAK_FLOPS, low_open=True, optional=True,
                              why="per device: 1,000x an H100's (MAX_PEAK_FLOPS)"),
        stop_after=IntRange(1, MAX_STEPS, "optim.steps's maximum (MAX_STEPS)", optional=True),
    )

    def __post_init__(self) -> None:
        check_values("run", self)


@config_section
class TrainConfig:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = dataclasses.field(default_factory=TokenizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    run: RunConfig = dataclasses.field(default_factory=RunConfig)

    LIMITS: ClassVar[dict] = {}  # its sections check their own

    def __post_init__(self) -> None:
        m, d, o, p = self.model, self.data, self.optim, self.parallel
        positions = m.resolved("max_position_embeddings")
        if d.seq_len > positions:
            raise ValueError(f"data.seq_len ({d.seq_len}) is larger than the model's positions "
                             f"(model.max_position_embeddings = {positions}); lower data.seq_len or raise "
                             f"model.max_position_embeddings")
        per_step = p.microbatches * p.dp
        if o.batch_size % per_step:
            good = ", ".join(str(per_step * k) for k in range(1, 4))
            raise ValueError(f"optim.batch_size ({o.batch_size}) must be divisible by parallel.microbatches x "
                             f"parallel.dp ({p.microbatches} x {p.dp} = {per_step}); use e.g. {good}")
        if p.stages > m.resolved("num_layers"):
            raise ValueError(f"parallel.stages ({p.stages}) is more than the model's {m.resolved('num_layers')} "
                             f"layers (model.num_layers); each stage needs at least one layer")
        if not isinstance(p.layers, str) and sum(p.layers) != m.resolved("num_layers"):
            raise ValueError(f"parallel.layers = {list(p.layers)} gives {sum(p.layers)} decoder layers, but the model "
                             f"has {m.resolved('num_layers')} (model.num_layers)")
        if p.layers != "equal" and m.family == "gpt":
            raise ValueError(f"parallel.layers = {p.layers!r} needs model.family = \"llama\" (or \"qwen3_moe\", "
                             f"\"deepseek_v3\"; the gpt demo model splits its layers equally); use layers = \"equal\"")
        self._check_moe()
        self._check_context()
        if self.tokenizer.path is None and m.vocab_size is not None and m.vocab_size < self.tokenizer.vocab_size:
            raise ValueError(f"model.vocab_size ({m.vocab_size}) is smaller than tokenizer.vocab_size "
                             f"({self.tokenizer.vocab_size})")
        if self.run.stop_after is not None and self.run.stop_after > o.steps:
            raise ValueError(f"run.stop_after ({self.run.stop_after}) is after optim.steps ({o.steps})")

    def _check_context(self) -> None:
        """Context parallelism and document masking against the data and the model (the runtime's
        own refusals, tp and zero with cp, TeraPipe: ``check_pipeline`` in checks.py)."""
        d, p = self.data, self.parallel
        if p.cp > 1 and d.seq_len % (2 * p.cp):
            step = 2 * p.cp
            low, high = d.seq_len // step * step, (d.seq_len // step + 1) * step
            raise ValueError(f"data.seq_len ({d.seq_len}) must be divisible by 2 x parallel.cp = {step}: each "
                             f"sequence is cut in 2 x cp chunks, CP rank r holding chunks r and 2cp-1-r "
                             f"(docs/context.md); use data.seq_len = {high}" + (f" or {low}" if low else ""))
        if d.document_mask and p.schedule == SCHEDULE_AUTO:
            raise ValueError("data.document_mask with parallel.schedule = \"auto\": the planner measures the stages "
                             "on a sample without the documents' positions; name the schedule (the dry run's auto "
                             "table ranks them)")
        if (p.cp > 1 or d.document_mask) and self.model.family == "deepseek_v3":
            what = f"parallel.cp = {p.cp}" if p.cp > 1 else "data.document_mask = true"
            raise ValueError(f"{what} with model.family = \"deepseek_v3\": its multi-head latent attention has "
                             f"values narrower than its keys, which the ring attention does not take; use "
                             f"model.family = \"llama\" or \"qwen3_moe\", or parallel.cp = 1 and "
                             f"data.document_mask = false")

    def _check_moe(self) -> None:
        m, o, p = self.model, self.optim, self.parallel
        if m.family not in MOE_FAMILIES:
            wrong = [k for k, v in (("parallel.ep", p.ep > 1), ("optim.moe_aux_loss_coef", o.moe_aux_loss_coef),
                                    ("optim.moe_bias_update_rate", o.moe_bias_update_rate)) if v]
            if wrong:
                raise ValueError(f"{wrong[0]} is for a mixture of experts, but model.family = {m.family!r} has no "
                                 f"experts; use model.family = \"qwen3_moe\" or \"deepseek_v3\", or remove it")
            return
        if m.resolved("num_experts") % p.ep:
            raise ValueError(f"parallel.ep ({p.ep}) must divide model.num_experts ({m.resolved('num_experts')}): each "
                             f"expert-parallel rank holds an equal share of every layer's experts")
        if p.tp > 1:
            raise ValueError(f"parallel.tp = {p.tp} with model.family = {m.family!r}: tensor parallelism of a mixture "
                             f"of experts is not built (the experts' 3-D weights would need splitting over tp too); "
                             f"use parallel.ep (and dp) for the experts, tp = 1")
        if o.moe_bias_update_rate and m.family != "deepseek_v3":
            raise ValueError("optim.moe_bias_update_rate moves the router's expert bias, which only DeepSeek-V3's "
                             "sigmoid router has (model.family = \"deepseek_v3\"); use optim.moe_aux_loss_coef")
        if o.moe_bias_update_rate and p.recompute:
            raise ValueError("optim.moe_bias_update_rate with parallel.recompute: a recomputed forward runs each "
                             "router again and would count its tokens twice in the loads the bias step reads (the "
                             "runtime refuses it); set parallel.recompute = false, or balance with "
                             "optim.moe_aux_loss_coef instead")
