"""What ``mpmd train`` refuses before anything starts, shared by the run and its dry run
(``--dry-run`` refuses what the run would refuse)."""

from __future__ import annotations

from schedules import Kind

from ..runtime import PipelineConfig, build_schedule
from .config import SCHEDULE_AUTO, TrainConfig

__all__ = ["check_pipeline"]


def check_pipeline(cfg: TrainConfig) -> None:
    """The schedule against the stages and actors, as the Pipeline will build it: refused here,
    before anything starts."""
    p = cfg.parallel
    if p.schedule == SCHEDULE_AUTO:
        if p.compile:
            raise ValueError("parallel.compile with parallel.schedule = \"auto\" is refused: auto may pick a "
                             "schedule that splits the backward (zb-h1, zbv, ...), which compiled layers do not "
                             "support; name the schedule (1f1b, interleaved-1f1b, gpipe) or parallel.compile = false")
        return
    pc = PipelineConfig.from_options(num_actors=p.actors, dp=p.dp, device=p.device)
    try:
        sched = build_schedule(p.schedule, p.stages, pc, p.microbatches)
    except ValueError as e:
        raise ValueError(f"parallel: {e}") from None
    if p.compile and any(kind is Kind.I for kind in sched.backward_kind.values()):
        raise ValueError(f"parallel.compile with parallel.schedule = {p.schedule!r} is refused: that schedule splits "
                         f"the backward into input- and weight-gradient halves, which reads the autograd graph inside "
                         f"each layer, and a compiled layer hides it; use 1f1b, interleaved-1f1b or gpipe, or "
                         f"parallel.compile = false")
