"""Checking the Pipeline's arguments before any actor starts."""

from __future__ import annotations

import torch

import schedules
from schedules import Schedule

from ._config import PipelineConfig

__all__ = ["check_stages", "build_schedule", "unpack_batch"]


def check_stages(stages) -> list[torch.nn.Module]:
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
    return schedules.get_schedule(schedule, ranks, m, per)


def unpack_batch(batch):
    if isinstance(batch, dict) and {"inputs", "targets"} <= set(batch):
        return batch["inputs"], batch["targets"]
    try:
        inputs, targets = batch
    except (TypeError, ValueError):
        raise ValueError("each batch from data must be a pair (inputs, targets)") from None
    return inputs, targets
