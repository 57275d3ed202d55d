"""The Pipeline's options, typed and validated, and the checks of its other arguments
(the stage list, the schedule and where its stages go) before any actor starts."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

import schedules
from actors.update import Recipe
from schedules import Schedule

__all__ = ["PipelineConfig", "FUSION_MODES", "check_stages", "build_schedule", "recipe_of"]

FUSION_MODES = ("step", "consecutive", "none")


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
        if self.num_microbatches != "auto" and (not isinstance(self.num_microbatches, int)
                                                or self.num_microbatches < 1):
            raise ValueError(f"num_microbatches must be a positive integer or 'auto', got {self.num_microbatches!r}")
        if self.memory_limit_bytes is not None and not self.memory_limit_bytes > 0:
            raise ValueError(f"memory_limit_bytes must be > 0 (per actor, for schedule='auto'), "
                             f"got {self.memory_limit_bytes!r}")
        if self.num_actors is not None and (not isinstance(self.num_actors, int) or self.num_actors < 1):
            raise ValueError(f"num_actors must be a positive integer or None, got {self.num_actors!r}")
        if not isinstance(self.dp, int) or self.dp < 1:
            raise ValueError(f"dp must be a positive integer, got {self.dp!r}")
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
        if max(self.tp_choices) > 1 and self.tp_plan is None:
            raise ValueError(f"tp={self.tp} shards every stage over {max(self.tp_choices)} actors and needs a plan: pass "
                             "tp_plan='auto' (built-in plans for Hugging Face Llama-style stages and mpmd.models.GPTStage), "
                             "a dict {module name: ColwiseParallel() / RowwiseParallel()} or a function "
                             "(stage_index, module, mesh) -> None")
        if not isinstance(self.loss_parallel, bool):
            raise ValueError(f"loss_parallel must be True or False, got {self.loss_parallel!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {self.device!r}")
        if self.fusion not in FUSION_MODES:
            raise ValueError(f"unknown fusion mode {self.fusion!r}; use one of {', '.join(FUSION_MODES)}")
        if not isinstance(self.auto_calibrate, bool):
            raise ValueError(f"auto_calibrate must be True or False, got {self.auto_calibrate!r}")
        if not isinstance(self.step_channel, bool):
            raise ValueError(f"step_channel must be True or False, got {self.step_channel!r}")
        if self.placement not in ("pack", "spread"):
            raise ValueError(f"placement must be 'pack' or 'spread', got {self.placement!r}")
        if self.num_cpus < 0 or (self.num_gpus is not None and self.num_gpus < 0):
            raise ValueError("num_cpus and num_gpus per actor must be >= 0")
        if not isinstance(self.spare_actors, int) or isinstance(self.spare_actors, bool) or self.spare_actors < 0:
            raise ValueError(f"spare_actors must be an integer >= 0, got {self.spare_actors!r}")
        if self.bucket_bytes < 0:
            raise ValueError(f"bucket_bytes must be >= 0 (0: one all-reduce per tensor), got {self.bucket_bytes}")
        if self.comm_timeout_s <= 0:
            raise ValueError(f"comm_timeout_s must be > 0, got {self.comm_timeout_s}")
        if self.transport not in ("auto", "nccl", "gloo", "staged", "nccl-order"):
            raise ValueError(f"transport must be 'auto', 'nccl', 'gloo', 'staged' or 'nccl-order', got "
                             f"{self.transport!r}")
        if self.on_nan not in ("raise", "skip"):
            raise ValueError(f"on_nan must be 'raise' or 'skip', got {self.on_nan!r}")
        if self.clip_grad_norm is not None and not (isinstance(self.clip_grad_norm, (int, float))
                                                    and self.clip_grad_norm > 0):
            raise ValueError(f"clip_grad_norm must be a number > 0 (or None: no clipping), got {self.clip_grad_norm!r}")
        if not isinstance(self.clip_norm_type, (int, float)) or not self.clip_norm_type > 0:
            raise ValueError(f"clip_norm_type must be > 0 (2.0, or float('inf')), got {self.clip_norm_type!r}")
        if self.precision not in ("fp32", "bf16", "fp16"):
            raise ValueError(f"precision must be 'fp32', 'bf16' or 'fp16', got {self.precision!r}")
        if isinstance(self.recompute, list):
            object.__setattr__(self, "recompute", tuple(self.recompute))
        if not isinstance(self.recompute, (bool, tuple)) or (isinstance(self.recompute, tuple) and not all(
                isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.recompute)):
            raise ValueError(f"recompute must be True, False or a list of stage indices, got {self.recompute!r}")

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
