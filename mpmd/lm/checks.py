"""What ``mpmd train`` refuses before anything starts, shared by the run and its dry run
(``--dry-run`` refuses what the run would refuse)."""

from __future__ import annotations

from schedules import Kind
from schedules.token_sliced import TOKEN_SLICED_NAMES

from ..runtime import PipelineConfig, build_schedule
from ..runtime.config import FLAT_OPTIONS
from ..runtime.cp import check_cp_pipeline
from .config import SCHEDULE_AUTO, TrainConfig
from .recipe import pipeline_options

__all__ = ["check_pipeline"]


def check_pipeline(cfg: TrainConfig) -> None:
    """The schedule against the stages and actors, as the Pipeline will build it: refused here,
    before anything starts."""
    p = cfg.parallel
    _check_layout(cfg)
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


def _check_layout(cfg: TrainConfig) -> None:
    """The actors' layout as the Pipeline will take it: what the runtime refuses of it (ep not
    dividing dp x cp, cp or document masking with TeraPipe's token slices or the planner's
    choices) is refused here by the runtime's own checks, before the data is prepared.  The
    stages' attention is checked when the Pipeline is built (on the meta device, before any
    actor starts)."""
    options = pipeline_options(cfg.parallel, cfg.optim, cfg.data.document_mask)
    try:
        layout = PipelineConfig.from_options(**{k: v for k, v in options.items() if k in FLAT_OPTIONS}).layout
        check_cp_pipeline((), layout, None, sliced=cfg.parallel.schedule in TOKEN_SLICED_NAMES,
                          planned=cfg.parallel.schedule == SCHEDULE_AUTO)
    except ValueError as e:
        raise ValueError(f"parallel: {e} (parallel.tp, parallel.zero, parallel.cp, parallel.schedule, "
                         f"data.document_mask in the config)") from None
