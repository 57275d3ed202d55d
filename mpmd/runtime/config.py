"""The Pipeline's options, typed and validated, and the checks of its other arguments
(the stage list, the schedule and where its stages go) before any actor starts."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional, Union

import torch

import schedules
from actors.update import Recipe
from schedules import Schedule

__all__ = ["PipelineConfig", "FUSION_MODES", "check_stages", "build_schedule", "recipe_of", "IntRange", "FloatRange",
           "MAX_MICROBATCHES", "MAX_SEED", "MAX_ACTORS", "MAX_TIMEOUT_S", "MAX_MEMORY_BYTES", "MAX_BUCKET_BYTES"]

FUSION_MODES = ("step", "consecutive", "none")

# Note [numeric limits]
# Every number of a configuration is checked before anything starts.  A float must be finite:
# NaN compares False with everything, so a check written ``if x <= 0: raise`` lets it through,
# and it then reaches the actors (a NaN learning rate writes a NaN checkpoint).  An integer must
# be an int, not a bool (``True`` is an int to Python), in a range whose maximum is far above
# any real run yet low enough that what is built from the value before the first step (a
# schedule lists every microbatch's actions; Ray is asked for every actor) takes seconds, not a
# day.  ``IntRange`` and ``FloatRange`` check one option each and name it; the LM config
# (mpmd/lm/config.py) declares one per numeric key with these maxima.

# per replica and step.  A schedule holds every microbatch's actions on every rank; it is built,
# lowered and simulated before the first step (and by --dry-run): about 5 s to build and 40 s to
# dry-run at 65,536 for 2 stages on a 2-core machine, a day at 10**9.  Real runs use 4-8 per stage.
MAX_MICROBATCHES = 65_536
# numpy's legacy seeding takes [0, 2**32); stage_seed(seed, s) = seed * 1_000_003 + s (actors/build.py)
# then stays far below torch.manual_seed's 2**64.
MAX_SEED = 2 ** 32 - 1
# devices of one pipeline (actors x dp x tp, spare actors): 4x the largest clusters reported for one
# training run (16,384 GPUs for Llama 3 405B); Ray is asked for each.
MAX_ACTORS = 65_536
# a week: a longer timeout is no limit in effect, and the actors' deadlines (datetime.timedelta) need
# a number they can hold.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_MEMORY_BYTES = 2 ** 50  # per actor: 1 PiB, 8,000x an H200's 141 GB
MAX_BUCKET_BYTES = 2 ** 40  # 1 TiB: every real model's gradients fit in one bucket below it


@dataclasses.dataclass(frozen=True)
class IntRange:
    """An integer option's range, ``low`` to ``high`` inclusive (None allowed with ``optional``);
    ``why`` says what the maximum protects (Note [numeric limits])."""

    low: int
    high: int
    why: str = ""
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        """``value`` in range, or a ``ValueError`` naming ``name`` and the range."""
        if value is None and self.optional:
            return
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > self.high:
            raise ValueError(f"{name} = {_shown(value)} is more than the maximum {self.high:,}"
                             f"{': ' + self.why if self.why else ''}")
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < self.low:
            raise ValueError(f"{name} must be {self}{' or None' if self.optional else ''}, got {_shown(value)}")

    def __str__(self) -> str:
        kind = {0: "an integer >= 0", 1: "a positive integer"}.get(self.low, f"an integer >= {self.low:,}")
        return f"{kind} (at most {self.high:,})"

    @property
    def span(self) -> str:
        """The range in short: "1 to 65,536"."""
        return f"{self.low:,} to {self.high:,}"


@dataclasses.dataclass(frozen=True)
class FloatRange:
    """A float option's range: finite (``inf_ok``: +inf too), above ``low`` (included unless
    ``low_open``), at most ``high`` (excluded with ``high_open``); None allowed with ``optional``."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    inf_ok: bool = False
    why: str = ""
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        """``value`` finite and in range, or a ``ValueError`` naming ``name`` and the range."""
        if value is None and self.optional:
            return
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        finite = real and (isinstance(value, numbers.Integral) or math.isfinite(value))  # a huge int has no float
        if not (finite or (real and self.inf_ok and value == math.inf)):
            raise ValueError(f"{name} must be {self}{' or None' if self.optional else ''}, got {_shown(value)}")
        if value > self.high and self.why and finite:
            raise ValueError(f"{name} = {_shown(value)} is more than the maximum {_number(self.high)}: {self.why}")
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if below or above:
            raise ValueError(f"{name} must be {self}{' or None' if self.optional else ''}, got {_shown(value)}")

    def __str__(self) -> str:
        kind = "a number" if self.inf_ok else "a finite number"
        return f"{kind}{' in' if self.span.startswith(('(', '[')) else ''} {self.span}"

    @property
    def span(self) -> str:
        """The range in short: "> 0", "[0, 1)", "> 0 or inf"."""
        if math.isinf(self.high):
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
            return text + (" or inf" if self.inf_ok else "")
        return (f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _shown(value: Any) -> str:
    """``value`` for a message, a huge integer cut short: 1,000,000,000 or 10000000000...(401 digits)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        text = f"{value:,}"
        return text if len(text) <= 40 else f"{str(value)[:12]}...({len(str(abs(value)))} digits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(x: float) -> str:
    """``x`` for a message: 604,800, 0.5 or 2**-20."""
    if float(x).is_integer() and abs(x) < 1e18:
        return f"{x:,.0f}"
    mantissa, exponent = math.frexp(x)
    return f"2**{exponent - 1}" if mantissa == 0.5 and exponent < -9 else f"{x:g}"


# PipelineConfig's numbers, each checked by its range (Note [numeric limits]); num_microbatches,
# tp and memory_limit_bytes also take other forms, checked in __post_init__.
_TIMEOUT_WHY = "a week (MAX_TIMEOUT_S) is no limit in effect"
_NUMBERS = {
    "num_actors": IntRange(1, MAX_ACTORS, "the actors of one pipeline replica (MAX_ACTORS)", optional=True),
    "dp": IntRange(1, MAX_ACTORS, "data-parallel replicas (MAX_ACTORS)"),
    "spare_actors": IntRange(0, MAX_ACTORS, "idle actors kept for restarts (MAX_ACTORS)"),
    "bucket_bytes": IntRange(0, MAX_BUCKET_BYTES, "1 TiB (MAX_BUCKET_BYTES) holds any model's gradients in one bucket"),
    "seed": IntRange(0, MAX_SEED, "numpy seeds in [0, 2**32) and torch.manual_seed takes seed x 1,000,003 + stage "
                                  "(MAX_SEED)"),
    # per actor, which runs on one node: more than a node has leaves it unplaced for good
    "num_cpus": FloatRange(0.0, 4096.0, why="more CPUs than one node has (an actor runs on one)"),
    "num_gpus": FloatRange(0.0, 64.0, why="more GPUs than one node has (an actor runs on one)", optional=True),
    "comm_timeout_s": FloatRange(0.0, MAX_TIMEOUT_S, low_open=True, why=_TIMEOUT_WHY),
    "step_timeout_s": FloatRange(0.0, MAX_TIMEOUT_S, low_open=True, why=_TIMEOUT_WHY + "; None: no limit",
                                 optional=True),
    "clip_grad_norm": FloatRange(0.0, low_open=True, optional=True),  # None: no clipping
    "clip_norm_type": FloatRange(0.0, low_open=True, inf_ok=True),  # float("inf"): the largest element
}
_MICROBATCHES = IntRange(1, MAX_MICROBATCHES, "a schedule lists every microbatch's actions and is built before the "
                                              "first step (MAX_MICROBATCHES); use fewer, larger microbatches")
_TP = IntRange(1, MAX_ACTORS, "the devices a stage is sharded over (MAX_ACTORS)")
_MEMORY = FloatRange(0.0, MAX_MEMORY_BYTES, low_open=True, why="1 PiB per actor (MAX_MEMORY_BYTES)")
_FLAGS = ("loss_parallel", "step_channel", "overlap_reduce", "dynamic_shapes", "auto_calibrate")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    num_microbatches: Union[int, str] = 4  # or "auto": mpmd.planning.auto chooses (Pipeline(sample=...))
    num_actors: Optional[int] = None
    dp: int = 1
    zero: int = 0  # 1: the dp replicas split their stages' optimizer state (Note [ZeRO-1 sharding] in actors/zero.py)
    # actors per pipeline rank, a stage sharded over them (Note [tensor parallelism], actors/tensor_parallel.py);
    # a tuple: choices schedule="auto" decides among (Note [TP cost model] in mpmd/planning/tp.py)
    tp: Union[int, tuple[int, ...]] = 1
    tp_plan: Any = None  # "auto", {module name: ParallelStyle} or fn(stage_index, module, mesh) (mpmd/tensor_parallel)
    # under tp: the LM head's logits stay sharded over the vocabulary and the loss is computed on the
    # shards (torch's loss_parallel(): cross_entropy only; Note [vocabulary-parallel loss])
    loss_parallel: bool = False
    device: str = "auto"
    address: Optional[str] = None
    fusion: str = "step"
    step_channel: bool = True  # fusion="step": each step over a persistent socket per actor (Note [step channel])
    placement: str = "pack"
    num_cpus: float = 1.0
    num_gpus: Optional[float] = None
    spare_actors: int = 0  # idle actors a restart uses instead of new processes (Note [spare actors])
    bucket_bytes: int = 4 << 20
    # dp > 1: each bucket's average starts inside its stage's last backward, as its gradients
    # become final; False: all of them at the stage's ALLREDUCE (Note [overlapped dp reduction])
    overlap_reduce: bool = True
    comm_timeout_s: float = 30.0
    step_timeout_s: Optional[float] = None
    dynamic_shapes: bool = False
    seed: int = 0
    memory_limit_bytes: Optional[int] = None  # per actor, for schedule/num_microbatches="auto"
    on_nan: str = "raise"  # non-finite loss or gradient: "raise" (FloatingPointError) or "skip"; no update either way
    clip_grad_norm: Optional[float] = None  # the global gradient norm's maximum (actors/update.py)
    clip_norm_type: float = 2.0  # the norm's p (float("inf"): the largest element)
    precision: str = "fp32"  # "fp32" | "bf16" (autocast) | "fp16" (autocast, dynamic loss scaling)
    recompute: Union[bool, tuple[int, ...]] = False  # True or stage indices: recompute forwards in the backward
    transport: str = "auto"  # "auto" | "nccl" | "gloo" | "staged" (mpmd/runtime/transport.py)
    auto_calibrate: bool = True  # "auto" re-decides from a trial on the actors (Note [calibrated auto])

    def __post_init__(self) -> None:
        self._check_numbers()
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
        devices = (self.num_actors or 1) * self.dp * max(self.tp_choices)
        if devices > MAX_ACTORS:
            raise ValueError(f"num_actors x dp x tp = {self.num_actors or 1} x {self.dp} x {max(self.tp_choices)} = "
                             f"{devices:,} actors is more than the maximum {MAX_ACTORS:,} (MAX_ACTORS)")
        if max(self.tp_choices) > 1 and self.tp_plan is None:
            raise ValueError(f"tp={self.tp} shards every stage over {max(self.tp_choices)} actors and needs a plan: pass "
                             "tp_plan='auto' (built-in plans for Hugging Face Llama-style stages and mpmd.models.GPTStage), "
                             "a dict {module name: ColwiseParallel() / RowwiseParallel()} or a function "
                             "(stage_index, module, mesh) -> None")
        for name in _FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {self.fusion!r}; use one of {', '.join(FUSION_MODES)}")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"placement must be 'pack' or 'spread', got {self.placement!r}")
        if self.transport not in ("auto", "nccl", "gloo", "staged", "nccl-order"):
            raise ValueError(f"transport must be 'auto', 'nccl', 'gloo', 'staged' or 'nccl-order', got "
                             f"{self.transport!r}")
        if self.on_nan not in ("raise", "skip"):
            raise ValueError(f"on_nan must be 'raise' or 'skip', got {self.on_nan!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if isinstance(self.recompute, list):
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if not isinstance(self.recompute, (bool, tuple)) or (isinstance(self.recompute, tuple) and not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.recompute)):
            raise ValueError(f"recompute must be True, False or a list of stage indices, got {self.recompute!r}")

    def _check_numbers(self) -> None:
        """Every number finite and in its range, named (Note [numeric limits])."""
        m = self.num_microbatches
        if m != "auto":
            if not isinstance(m, int) or isinstance(m, bool) or m < 1:
                raise ValueError(f"num_microbatches must be a positive integer or 'auto', got {m!r}")
            _MICROBATCHES.check("num_microbatches", m)
        limit = self.memory_limit_bytes
        if limit is not None:
            if not (isinstance(limit, numbers.Real) and not isinstance(limit, bool) and limit > 0):
                raise ValueError(f"memory_limit_bytes must be > 0 (per actor, for schedule='auto'), got {limit!r}")
            _MEMORY.check("memory_limit_bytes", limit)
        for name, allowed in _NUMBERS.items():
            allowed.check(name, getattr(self, name))

    @property
    def tp_choices(self) -> tuple[int, ...]:
        """``tp`` as a tuple: the one degree, or the choices ``schedule="auto"`` decides among."""
        return self.tp if isinstance(self.tp, tuple) else (self.tp,)


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


def build_schedule(schedule, num_stages: int, cfg: PipelineConfig) -> Schedule:
    """The validated schedule for a registered name (stages placed on ``cfg.num_actors``
    actors, or at the schedule's default stages per actor; its free split backwards fused,
    ``schedules.fuse_backwards``) or a ``schedules.Schedule`` (as it is)."""
    m = cfg.num_microbatches
    if isinstance(schedule, Schedule):
        if schedule.num_stages != num_stages:
            raise ValueError(f"the schedule has {schedule.num_stages} stages but {num_stages} stage modules were given")
        if schedule.num_microbatches != m:
            raise ValueError(f"the schedule is for {schedule.num_microbatches} microbatches but "
                             f"num_microbatches={m}; pass num_microbatches={schedule.num_microbatches}")
        return schedules.validate(schedule)
    if not isinstance(schedule, str):
        raise ValueError(f"schedule must be a name ({', '.join(schedules.schedule_names())}) or a schedules.Schedule")
    info = schedules.schedule_info(schedule)
    if cfg.num_actors is not None:
        ranks = cfg.num_actors
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
    return schedules.fuse_backwards(schedules.get_schedule(schedule, ranks, m, per))


def recipe_of(cfg: PipelineConfig, num_stages: int) -> Recipe:
    """How the actors update their stages (``actors/update.py``), from the configuration."""
    recompute = tuple(range(num_stages)) if cfg.recompute is True else tuple(cfg.recompute or ())
    bad = [s for s in recompute if s >= num_stages]
    if bad:
        raise ValueError(f"recompute names stage {bad[0]}, but the stages are 0..{num_stages - 1}")
    return Recipe(clip_grad_norm=cfg.clip_grad_norm, clip_norm_type=float(cfg.clip_norm_type),
                  precision=cfg.precision, recompute=recompute, loss_parallel=cfg.loss_parallel and cfg.tp > 1)
