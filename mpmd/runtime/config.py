"""The Pipeline's options, typed and validated, one home each: ``PipelineConfig`` holds one
group per concern (the device layout, the cluster, how steps are dispatched, the actors'
communication, the training recipe, the planner's), each a frozen dataclass checked in its
``__post_init__``; and the checks of the Pipeline's other arguments (the stage list, the
schedule and where its stages go) before any actor starts.  The microbatch count is the
schedule's (``Schedule.num_microbatches``); ``build_schedule`` takes what was asked."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Optional, Union

import torch

import schedules
from actors.update import Recipe
from schedules import Schedule

from .limits import (MAX_ACTORS, MAX_BUCKET_BYTES, MAX_MEMORY_BYTES, MAX_MICROBATCHES, MAX_SEED, MAX_TIMEOUT_S,
                     FloatRange, IntRange)
from .overlap import as_asked, check_overlap, overlap_wanted

__all__ = ["PipelineConfig", "LayoutConfig", "ClusterConfig", "DispatchConfig", "CommConfig", "RecipeConfig",
           "PlanningConfig", "FLAT_OPTIONS", "FUSION_MODES", "check_stages", "check_microbatches", "build_schedule", "engine_config",
           "recipe_of", "IntRange", "FloatRange", "MAX_MICROBATCHES", "MAX_SEED", "MAX_ACTORS", "MAX_TIMEOUT_S",
           "MAX_MEMORY_BYTES", "MAX_BUCKET_BYTES"]

FUSION_MODES = ("step", "consecutive", "none")

# Each group's numbers: field -> (the Pipeline keyword an error names, its range; Note [numeric
# limits] in limits.py).  num_microbatches, tp and memory_limit_bytes also take other forms,
# checked where they live.
_TIMEOUT_WHY = "a week (MAX_TIMEOUT_S) is no limit in effect"
_MICROBATCHES = IntRange(1, MAX_MICROBATCHES, "a schedule lists every microbatch's actions and is built before the "
                                              "first step (MAX_MICROBATCHES); use fewer, larger microbatches")
_TP = IntRange(1, MAX_ACTORS, "the devices a stage is sharded over (MAX_ACTORS)")
_CP = IntRange(1, MAX_ACTORS, "the actors a stage's sequence is sharded over (MAX_ACTORS)")
_MEMORY = FloatRange(0.0, MAX_MEMORY_BYTES, low_open=True, why="1 PiB per actor (MAX_MEMORY_BYTES)")


def _check(group: Any, numbers_: dict, flags: tuple = ()) -> None:
    """``group``'s numbers in range and its flags True or False, each error naming the option."""
    for field, (keyword, allowed) in numbers_.items():
        allowed.check(keyword, getattr(group, field))
    for name in flags:
        if not isinstance(getattr(group, name), bool):
            raise ValueError(f"{name} must be True or False, got {getattr(group, name)!r}")


def check_microbatches(m: Any) -> None:
    """``num_microbatches`` as asked: a count in range or ``"auto"`` (mpmd.planning chooses)."""
    if m != "auto":
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"num_microbatches must be a positive integer or 'auto', got {m!r}")
        _MICROBATCHES.check("num_microbatches", m)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """The device grid, pipeline ranks x data-parallel replicas x tensor-parallel shards (Note
    [device grid] in actors/grid.py), and what rides on it.  ``pp`` counts pipeline ranks only;
    the actors of a pipeline are ``pp x dp x tp`` (``Engine.num_actors``)."""

    pp: Optional[int] = None  # pipeline ranks (Pipeline(num_actors=...)); None: the schedule's stages per rank
    dp: int = 1
    # actors per pipeline rank, a stage sharded over them (Note [tensor parallelism], actors/tensor_parallel.py);
    # a tuple: choices schedule="auto" decides among (Note [TP cost model] in mpmd/planning/tp.py)
    tp: Union[int, tuple[int, ...]] = 1
    tp_plan: Any = None  # "auto", {module name: ParallelStyle} or fn(stage_index, module, mesh) (mpmd/tensor_parallel)
    # under tp: the LM head's logits stay sharded over the vocabulary and the loss is computed on the
    # shards (torch's loss_parallel(): cross_entropy only; Note [vocabulary-parallel loss])
    loss_parallel: bool = False
    # 1: the dp x cp actors of a rank split their stages' optimizer state (Note [ZeRO-1 sharding] in actors/zero.py)
    zero: int = 0
    # expert parallelism: each MoE block's experts split over ``ep`` of a rank's dp x cp actors (Note
    # [expert parallelism] in actors/grid.py); the rest of the stage stays replicated over them
    ep: int = 1
    # one microbatch's forward and another's backward overlapped where the schedule pairs them
    # ("auto": dualpipev at ep > 1), hiding ep's all-to-alls (docs/overlap.md)
    overlap: Union[str, bool] = "auto"
    # context parallelism: every microbatch's sequence zigzag-sharded over ``cp`` actors of a stage, attention
    # exact across them (Note [context-parallel runtime] in actors/cp_runtime.py; docs/context.md)
    cp: int = 1
    # packed documents: attention only within each document, positions restarting per document; each step
    # passes ``position_ids`` (restarting at 0 at each document) as a side input (docs/context.md)
    document_mask: bool = False

    def __post_init__(self) -> None:
        _check(self, {"pp": ("num_actors", IntRange(1, MAX_ACTORS, "the actors of one pipeline replica (MAX_ACTORS)",
                                                    optional=True)),
                      "dp": ("dp", IntRange(1, MAX_ACTORS, "data-parallel replicas (MAX_ACTORS)"))})
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 1:
            raise ValueError(f"ep must be a positive integer (the dp x cp actors of a stage a MoE block's experts split "
                             f"over), got {self.ep!r}")
        _CP.check("cp", self.cp)
        check_overlap(self.overlap, self.cp)
        if (self.dp * self.cp) % self.ep:
            raise ValueError(f"ep={self.ep} must divide dp={self.dp} x cp={self.cp}: the expert-parallel ranks are "
                             f"drawn from a pipeline rank's data- and context-parallel actors (Note [expert parallelism] "
                             f"in actors/grid.py); use a dp x cp that is a multiple of {self.ep}, or an ep that divides "
                             f"{self.dp * self.cp}")
        if self.zero not in (0, 1) or isinstance(self.zero, bool):
            raise ValueError(f"zero must be 0 (every replica holds the whole optimizer state) or 1 (the dp replicas "
                             f"split it, ZeRO-1), got {self.zero!r}")
        if isinstance(self.tp, (tuple, list)):  # choices for the planner (schedule="auto"): one of them is an int
            tps = tuple(sorted(set(self.tp))) if all(isinstance(t, int) and not isinstance(t, bool) and t >= 1
                                                     for t in self.tp) else ()
            if not tps:
                raise ValueError(f"tp as choices must be a non-empty tuple of positive integers, e.g. tp=(1, 2), got "
                                 f"{self.tp!r}")
            object.__setattr__(self, "tp", tps[0] if len(tps) == 1 else tps)
        elif not isinstance(self.tp, int) or isinstance(self.tp, bool) or self.tp < 1:
            raise ValueError(f"tp must be a positive integer (the devices each stage is sharded over), got {self.tp!r}")
        for t in self.tp_choices:
            _TP.check("tp", t)
        devices = (self.pp or 1) * self.dp * self.cp * max(self.tp_choices)
        if devices > MAX_ACTORS:
            names, sizes = ("num_actors", "dp", "cp", "tp"), (self.pp or 1, self.dp, self.cp, max(self.tp_choices))
            shown = [(n, v) for n, v in zip(names, sizes) if n != "cp" or self.cp > 1]
            raise ValueError(f"{' x '.join(n for n, _ in shown)} = {' x '.join(str(v) for _, v in shown)} = "
                             f"{devices:,} actors is more than the maximum {MAX_ACTORS:,} (MAX_ACTORS)")
        if max(self.tp_choices) > 1 and self.tp_plan is None:
            raise ValueError(f"tp={self.tp} shards every stage over {max(self.tp_choices)} actors and needs a plan: pass "
                             "tp_plan='auto' (built-in plans for Hugging Face Llama-style stages and mpmd.models.GPTStage), "
                             "a dict {module name: ColwiseParallel() / RowwiseParallel()} or a function "
                             "(stage_index, module, mesh) -> None")
        _check(self, {}, ("loss_parallel", "document_mask"))
        if self.ep > 1 and max(self.tp_choices) > 1:
            raise ValueError(f"tp={self.tp} with ep={self.ep} is not supported: the experts' weights would have to be "
                             "split over the TP ranks too, which is not built; use tp=1 with ep > 1, or ep=1 with tp")

    @property
    def reducing(self) -> int:
        """How many actors of a pipeline rank average its gradients: ``dp x cp`` (Note [device grid])."""
        return self.dp * self.cp

    @property
    def tp_choices(self) -> tuple[int, ...]:
        """``tp`` as a tuple: the one degree, or the choices ``schedule="auto"`` decides among."""
        return self.tp if isinstance(self.tp, tuple) else (self.tp,)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """Where the actors run: the Ray cluster, the device kind, each actor's share of a node."""

    address: Optional[str] = None
    device: str = "auto"
    num_cpus: float = 1.0
    num_gpus: Optional[float] = None
    placement: str = "pack"
    spare_actors: int = 0  # idle actors a restart uses instead of new processes (Note [spare actors])

    def __post_init__(self) -> None:
        # per actor, which runs on one node: more than a node has leaves it unplaced for good
        _check(self, {"spare_actors": ("spare_actors", IntRange(0, MAX_ACTORS, "idle actors kept for restarts "
                                                                               "(MAX_ACTORS)")),
                      "num_cpus": ("num_cpus", FloatRange(0.0, 4096.0, why="more CPUs than one node has (an actor "
                                                                            "runs on one)")),
                      "num_gpus": ("num_gpus", FloatRange(0.0, 64.0, why="more GPUs than one node has (an actor runs "
                                                                          "on one)", optional=True))})
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"placement must be 'pack' or 'spread', got {self.placement!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DispatchConfig:
    """How the controller issues a step to the actors and how long it waits for one."""

    fusion: str = "step"
    step_channel: bool = True  # fusion="step": each step over a persistent socket per actor (Note [step channel])
    step_timeout_s: Optional[float] = None

    def __post_init__(self) -> None:
        _check(self, {"step_timeout_s": ("step_timeout_s", FloatRange(0.0, MAX_TIMEOUT_S, low_open=True, optional=True,
                                                                      why=_TIMEOUT_WHY + "; None: no limit"))},
               ("step_channel",))
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {self.fusion!r}; use one of {', '.join(FUSION_MODES)}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CommConfig:
    """How the actors talk among themselves: the transport, the dp reduction's buckets, shapes."""

    transport: str = "auto"  # "auto" | "nccl" | "gloo" | "staged" (mpmd/runtime/transport.py)
    bucket_bytes: int = 4 << 20
    # dp > 1: each bucket's average starts inside its stage's last backward, as its gradients
    # become final; False: all of them at the stage's ALLREDUCE (Note [overlapped dp reduction])
    overlap_reduce: bool = True
    timeout_s: float = 30.0  # Pipeline(comm_timeout_s=...)
    dynamic_shapes: bool = False  # each forward send announces its shapes (actors/transfers.py)

    def __post_init__(self) -> None:
        _check(self, {"bucket_bytes": ("bucket_bytes", IntRange(0, MAX_BUCKET_BYTES, "1 TiB (MAX_BUCKET_BYTES) holds "
                                                                                     "any model's gradients in one "
                                                                                     "bucket")),
                      "timeout_s": ("comm_timeout_s", FloatRange(0.0, MAX_TIMEOUT_S, low_open=True, why=_TIMEOUT_WHY))},
               ("overlap_reduce", "dynamic_shapes"))
        if self.transport not in ("auto", "nccl", "gloo", "staged", "nccl-order"):
            raise ValueError(f"transport must be 'auto', 'nccl', 'gloo', 'staged' or 'nccl-order', got "
                             f"{self.transport!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecipeConfig:
    """How the stages train: seeds, precision, clipping, recompute, a non-finite loss (``recipe_of``)."""

    seed: int = 0
    precision: str = "fp32"  # "fp32" | "bf16" (autocast) | "fp16" (autocast, dynamic loss scaling)
    clip_grad_norm: Optional[float] = None  # the global gradient norm's maximum (actors/update.py)
    clip_norm_type: float = 2.0  # the norm's p (float("inf"): the largest element)
    recompute: Union[bool, tuple[int, ...]] = False  # True or stage indices: recompute forwards in the backward
    on_nan: str = "raise"  # non-finite loss or gradient: "raise" (FloatingPointError) or "skip"; no update either way
    # MoE blocks (actors/experts.py, docs/moe.md): the per-microbatch load-balancing loss's weight,
    # and DeepSeek's auxiliary-loss-free bias step (routers with ``e_score_correction_bias``)
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0

    def __post_init__(self) -> None:
        _check(self, {"seed": ("seed", IntRange(0, MAX_SEED, "numpy seeds in [0, 2**32) and torch.manual_seed takes "
                                                             "seed x 1,000,003 + stage (MAX_SEED)")),
                      "moe_aux_loss_coef": ("moe_aux_loss_coef", FloatRange(0.0)),
                      "moe_bias_update_rate": ("moe_bias_update_rate", FloatRange(0.0)),
                      "clip_grad_norm": ("clip_grad_norm", FloatRange(0.0, low_open=True, optional=True)),  # None: off
                      "clip_norm_type": ("clip_norm_type", FloatRange(0.0, low_open=True, inf_ok=True))})
        if self.on_nan not in ("raise", "skip"):
            raise ValueError(f"on_nan must be 'raise' or 'skip', got {self.on_nan!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if isinstance(self.recompute, list):
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if self.recompute and self.moe_bias_update_rate:
            raise ValueError("recompute with moe_bias_update_rate > 0 is not supported: recomputing a forward inside "
                             "the backward runs each MoE router again and would count its tokens twice in the loads "
                             "the bias step reads; use recompute=False with the bias update")
        if not isinstance(self.recompute, (bool, tuple)) or (isinstance(self.recompute, tuple) and not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.recompute)):
            raise ValueError(f"recompute must be True, False or a list of stage indices, got {self.recompute!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """What ``schedule="auto"`` / ``num_microbatches="auto"`` / tp choices may do (mpmd/planning)."""

    memory_limit_bytes: Optional[int] = None  # per actor, for schedule/num_microbatches="auto"
    auto_calibrate: bool = True  # "auto" re-decides from a trial on the actors (Note [calibrated auto])
    # zero was not given: the planner turns zero=1 on where only it fits (dp > 1); Pipeline sets it
    choose_zero: bool = False

    def __post_init__(self) -> None:
        limit = self.memory_limit_bytes
        if limit is not None:
            if not (isinstance(limit, numbers.Real) and not isinstance(limit, bool) and limit > 0):
                raise ValueError(f"memory_limit_bytes must be > 0 (per actor, for schedule='auto'), got {limit!r}")
            _MEMORY.check("memory_limit_bytes", limit)
        _check(self, {}, ("auto_calibrate", "choose_zero"))


_GROUPS = {"layout": LayoutConfig, "cluster": ClusterConfig, "dispatch": DispatchConfig, "comm": CommConfig,
           "recipe": RecipeConfig, "planning": PlanningConfig}

# Note [flat options]
# ``Pipeline(...)`` takes each option as one flat keyword (``num_actors=2, dp=2, comm_timeout_s=60``),
# and a checkpoint's manifest keeps them by those names (mpmd/training/manifest.py), so old
# manifests load as they are.  This table places each keyword in its group, here and nowhere
# else: ``PipelineConfig.from_options`` reads them, ``PipelineConfig.option`` gives one back.
FLAT_OPTIONS: dict[str, tuple[str, str]] = {
    "num_actors": ("layout", "pp"), "dp": ("layout", "dp"), "tp": ("layout", "tp"), "tp_plan": ("layout", "tp_plan"),
    "loss_parallel": ("layout", "loss_parallel"), "zero": ("layout", "zero"), "ep": ("layout", "ep"),
    "overlap": ("layout", "overlap"),
    "cp": ("layout", "cp"), "document_mask": ("layout", "document_mask"),
    **{k: ("cluster", k) for k in ("address", "device", "num_cpus", "num_gpus", "placement", "spare_actors")},
    **{k: ("dispatch", k) for k in ("fusion", "step_channel", "step_timeout_s")},
    "transport": ("comm", "transport"), "bucket_bytes": ("comm", "bucket_bytes"),
    "overlap_reduce": ("comm", "overlap_reduce"), "comm_timeout_s": ("comm", "timeout_s"),
    "dynamic_shapes": ("comm", "dynamic_shapes"),
    **{k: ("recipe", k) for k in ("seed", "precision", "clip_grad_norm", "clip_norm_type", "recompute", "on_nan",
                                  "moe_aux_loss_coef", "moe_bias_update_rate")},
    **{k: ("planning", k) for k in ("memory_limit_bytes", "auto_calibrate")},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """Every option of a pipeline, one group per concern; ``PipelineConfig.from_options(dp=2,
    ...)`` builds one from ``Pipeline``'s flat keywords (Note [flat options]).  The microbatch
    count is not here: the schedule holds it."""

    layout: LayoutConfig = LayoutConfig()
    cluster: ClusterConfig = ClusterConfig()
    dispatch: DispatchConfig = DispatchConfig()
    comm: CommConfig = CommConfig()
    recipe: RecipeConfig = RecipeConfig()
    planning: PlanningConfig = PlanningConfig()

    def __post_init__(self) -> None:
        for name, cls in _GROUPS.items():
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"PipelineConfig's {name} must be a {cls.__name__}, got {getattr(self, name)!r}")

    @classmethod
    def from_options(cls, **options: Any) -> "PipelineConfig":
        """The configuration of ``Pipeline(**options)``'s flat keywords (Note [flat options]); an
        unknown keyword is a ``TypeError`` as from any call, a bad value a ``ValueError`` naming it.
        ``zero`` not given leaves it to the planner where it plans (``planning.choose_zero``)."""
        groups = {name: group() for name, group in _GROUPS.items()}
        groups["planning"] = PlanningConfig(choose_zero="zero" not in options)
        return cls(**_placed(groups, options))

    def option(self, keyword: str) -> Any:
        """The value of ``Pipeline``'s flat keyword ``keyword`` (Note [flat options])."""
        group, field = FLAT_OPTIONS[keyword]
        return getattr(getattr(self, group), field)


def _placed(groups: dict, options: dict) -> dict:
    """``groups`` with ``options`` (flat keywords) placed in them, each changed group validated."""
    changes: dict[str, dict] = {}
    for keyword, value in options.items():
        if keyword not in FLAT_OPTIONS:
            raise TypeError(f"PipelineConfig.__init__() got an unexpected keyword argument {keyword!r}")
        group, field = FLAT_OPTIONS[keyword]
        changes.setdefault(group, {})[field] = value
    return {name: dataclasses.replace(group, **changes[name]) if name in changes else group
            for name, group in groups.items()}




def check_stages(stages) -> list[torch.nn.Module]:
    """The stage modules as a list, or a ``ValueError`` saying what to pass instead."""
    if isinstance(stages, torch.nn.Module) and not isinstance(stages, (torch.nn.Sequential, torch.nn.ModuleList)):
        raise ValueError("stages must be a list of nn.Module, one per pipeline stage; "
                         "to cut one model into stages use mpmd.split(model, num_stages=...)")
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty: pass a list of nn.Module, one per pipeline stage")
    for i, s in enumerate(stages):
        if not isinstance(s, torch.nn.Module):
            raise ValueError(f"stages[{i}] is a {type(s).__name__}, not an nn.Module; "
                             "pass a list of nn.Module, one per pipeline stage")
    return stages


def build_schedule(schedule, num_stages: int, cfg: PipelineConfig, num_microbatches: Any) -> Schedule:
    """The validated schedule for a registered name (stages placed on ``cfg.layout.pp`` pipeline
    ranks, or at the schedule's default stages per rank; its free split backwards fused,
    ``schedules.fuse_backwards``) with ``num_microbatches``, or a ``schedules.Schedule`` (as it
    is, its count checked against ``num_microbatches`` as asked)."""
    m = num_microbatches
    check_microbatches(m)
    if isinstance(schedule, Schedule):
        if schedule.num_stages != num_stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages but {num_stages} stage modules were given")
        if schedule.num_microbatches != m:
            raise ValueError(f"the schedule is for {schedule.num_microbatches} microbatches but "
                             f"num_microbatches={m}; pass num_microbatches={schedule.num_microbatches}")
        return as_asked(schedules.validate(schedule), cfg.layout.overlap if cfg.layout.cp == 1 else False)
    if not isinstance(schedule, str):
        raise ValueError(f"schedule must be a name ({', '.join(schedules.schedule_names())}) or a schedules.Schedule")
    info = schedules.schedule_info(schedule)
    if cfg.layout.pp is not None:
        ranks = cfg.layout.pp
        if num_stages % ranks:
            raise ValueError(f"{num_stages} stages do not divide over num_actors={ranks}; "
                             f"use a num_actors that divides {num_stages}")
        per = num_stages // ranks
    else:
        per = info.default_stages_per_rank
        if num_stages % per:
            raise ValueError(f"{schedule} puts {per} stages on each actor, but {num_stages} stages were given; "
                             f"give a multiple of {per} stages")
        ranks = num_stages // per
    if info.allowed_stages_per_rank is not None and per not in info.allowed_stages_per_rank:
        need = " or ".join(str(v * ranks) for v in info.allowed_stages_per_rank)
        raise ValueError(f"{schedule} on {ranks} actors needs {need} stages, but {num_stages} were given; "
                         f"split the model into {need} stages or set num_actors")
    # A named schedule runs each split backward the timeline does not use fused (Note [fused
    # where free] in schedules/fuse.py); a Schedule given as such runs as written.
    overlap = overlap_wanted(schedule, cfg.layout.overlap, cfg.layout.ep, cfg.layout.cp)  # docs/overlap.md
    return schedules.fuse_backwards(schedules.get_schedule(schedule, ranks, m, per, overlap=overlap))


def recipe_of(cfg: PipelineConfig, num_stages: int) -> Recipe:
    """How the actors update their stages (``actors/update.py``), from the configuration."""
    rc = cfg.recipe
    recompute = tuple(range(num_stages)) if rc.recompute is True else tuple(rc.recompute or ())
    bad = [s for s in recompute if s >= num_stages]
    if bad:
        raise ValueError(f"recompute names stage {bad[0]}, but the stages are 0..{num_stages - 1}")
    return Recipe(clip_grad_norm=rc.clip_grad_norm, clip_norm_type=float(rc.clip_norm_type), precision=rc.precision,
                  recompute=recompute, loss_parallel=cfg.layout.loss_parallel and cfg.layout.tp > 1,
                  moe_aux_loss_coef=float(rc.moe_aux_loss_coef), moe_bias_update_rate=float(rc.moe_bias_update_rate))
