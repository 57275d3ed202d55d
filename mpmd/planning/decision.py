"""What ``schedule="auto"`` decided: the options it simulated (``Option``) and the choice
with its table (``Decision``); ``choose_schedule`` in ``auto.py`` makes them."""

from __future__ import annotations

import dataclasses
from typing import Optional

from ..runtime import PipelineConfig
from .costs import StageCost

__all__ = ["Option", "Decision", "fmt_bytes", "stages_text"]


@dataclasses.dataclass(frozen=True)
class Option:
    """One simulated candidate: predicted step time and the busiest actor's peak memory."""

    schedule: str
    num_ranks: int  # pipeline ranks (Pipeline(num_actors=...)); each tp actors per replica
    num_microbatches: int
    step_s: float
    bubble_fraction: float
    peak_bytes: float
    fits: bool
    recompute: tuple[int, ...] = ()  # stages whose forward is recomputed in the backward
    measured_s: Optional[float] = None  # the step time measured on the actors, for the options that ran
    zero: int = 0  # 1: the dp replicas split the optimizer state (Note [ZeRO-1 sharding])
    tp: int = 1  # the devices each stage is sharded over (Note [TP cost model] in tp.py)
    overlap: bool = False  # its forward-backward pairs run as OVERLAPs (docs/overlap.md)
    # the busiest rank's expert all-to-all seconds per step: waited on, and hidden by OVERLAPs
    # (SimResult.all_to_all, all_to_all_hidden; Note [all-to-all costs] in schedules/costs.py)
    a2a_s: float = 0.0
    a2a_hidden_s: float = 0.0

    @property
    def key(self) -> tuple:
        """What identifies the plan (not its prediction)."""
        return self.schedule, self.num_microbatches, self.num_ranks, self.recompute, self.zero, self.tp, self.overlap

    def applied(self, config: PipelineConfig) -> PipelineConfig:
        """``config`` running this option (its recompute, zero, tp and overlap; the microbatch
        count is its schedule's: ``build_schedule(self.schedule, ..., self.num_microbatches)``)."""
        return dataclasses.replace(
            config, layout=dataclasses.replace(config.layout, zero=self.zero, tp=self.tp, overlap=self.overlap),
            recipe=dataclasses.replace(config.recipe, recompute=self.recompute or config.recipe.recompute))


@dataclasses.dataclass(frozen=True)
class Decision:
    """What ``choose_schedule`` picked, with every option it simulated (fastest first)."""

    schedule: str
    num_microbatches: int
    num_ranks: int  # pipeline ranks
    predicted_step_s: float
    peak_bytes: float
    memory_limit_bytes: float
    options: tuple[Option, ...]
    skipped: tuple[tuple[str, int, str], ...]  # (schedule, m, why) the schedule's constraints refused
    stage_costs: tuple[StageCost, ...] = ()  # per stage, at the chosen microbatch size
    recompute: tuple[int, ...] = ()  # the stages to recompute (Pipeline(recompute=...))
    model_costs: tuple[StageCost, ...] = ()  # the per-stage costs decided from (Note [auto cost model])
    request: dict = dataclasses.field(default_factory=dict, compare=False)  # choose_schedule's other arguments
    calibration: tuple[str, ...] = ()  # what the actors measured and how it changed the plan (replan.py)
    provisional: Optional["Decision"] = None  # the decision from the controller's timing alone, before the trials
    zero: int = 0  # Pipeline(zero=...): 1 where the optimizer state is split over the dp replicas
    tp: int = 1  # Pipeline(tp=...): the tensor-parallel degree chosen
    overlap: bool = False  # Pipeline(overlap=...): the chosen schedule's pairs run as OVERLAPs

    @property
    def chosen(self) -> Option:
        key = (self.schedule, self.num_microbatches, self.num_ranks, self.recompute, self.zero, self.tp, self.overlap)
        return next(o for o in self.options if o.key == key)

    def table(self, limit: Optional[int] = 12) -> str:
        """The decision table: schedule, actors (pipeline ranks), tp (when it was a choice),
        m, predicted step time, bubble, peak memory (per actor)."""
        rows = list(self.options)
        if limit is not None and len(rows) > limit:
            rows = rows[:limit]
            if self.chosen not in rows:
                rows[-1] = self.chosen
        ran = any(o.measured_s is not None for o in self.options)
        tps = len({o.tp for o in self.options}) > 1  # a tp column when tp was a choice
        head = (f"  {'schedule':<18}{'actors':>7}" + (f"{'tp':>4}" if tps else "") + f"{'m':>5}{'step ms':>11}"
                + (f"{'measured':>10}" if ran else "")
                + f"{'bubble':>8}{'peak memory':>14}  fits")
        source = "the stages timed on the controller, corrected by trials on the actors" if self.calibration \
            else "the stages timed on the controller"
        lines = [f"schedule='auto': memory limit {fmt_bytes(self.memory_limit_bytes)} per actor; "
                 f"{len(self.options)} options simulated from {source}, {len(self.skipped)} refused by schedule "
                 f"constraints", head]
        for o in rows:
            mark = "*" if o == self.chosen else " "
            measured = "" if not ran else f"{o.measured_s * 1e3:>10.3f}" if o.measured_s is not None else f"{'-':>10}"
            lines.append(f"{mark} {o.schedule:<18}{o.num_ranks:>7}" + (f"{o.tp:>4}" if tps else "")
                         + f"{o.num_microbatches:>5}{o.step_s * 1e3:>11.3f}"
                         f"{measured}{o.bubble_fraction:>8.1%}{fmt_bytes(o.peak_bytes):>14}  "
                         f"{'yes' if o.fits else 'no'}"
                         + (f"  recompute {stages_text(o.recompute)}" if o.recompute else "")
                         + ("  zero=1" if o.zero else "") + ("  overlap" if o.overlap else ""))
        if len(self.options) > len(rows):
            lines.append(f"  ... {len(self.options) - len(rows)} slower options not shown")
        lines.append(f"chose {self.schedule} with num_microbatches={self.num_microbatches} on {self.num_ranks} "
                     + (f"pipeline ranks x tp={self.tp} ({self.num_ranks * self.tp} actors per replica)"
                        if tps or self.tp > 1 else "actors")
                     + f": predicted {self.predicted_step_s * 1e3:.3f} ms per step, "
                     f"{fmt_bytes(self.peak_bytes)} peak per actor"
                     + (f", recomputing stages {stages_text(self.recompute)}" if self.recompute else "")
                     + (("" if self.request.get("zero") == 1 else ", and zero=1: it fits only with the optimizer "
                         f"state split over the dp={self.request.get('dp')} replicas (ZeRO-1)") if self.zero else ""))
        return "\n".join(lines + self.overlap_lines() + list(self.calibration))

    def overlap_lines(self) -> list[str]:
        """What overlapping the chosen schedule's pairs buys (docs/overlap.md): its best option
        with OVERLAPs against its best without, at the chosen microbatch count; none where the
        options had no all-to-all or no pairs to overlap."""
        same = [o for o in self.options if (o.schedule, o.num_microbatches, o.tp) ==
                (self.schedule, self.num_microbatches, self.tp) and o.fits]
        paired, plain = [o for o in same if o.overlap], [o for o in same if not o.overlap]
        if not paired or not plain or not (paired[0].a2a_s + paired[0].a2a_hidden_s):
            return []
        on, off = paired[0], plain[0]
        gain = off.step_s - on.step_s
        return [f"overlap: {self.schedule} m={self.num_microbatches} with OVERLAPs {on.step_s * 1e3:.3f} ms against "
                f"{off.step_s * 1e3:.3f} ms without: {'saves' if gain >= 0 else 'costs'} {abs(gain) * 1e3:.3f} ms, "
                f"{abs(gain) / off.step_s:.1%} of the step; "
                f"all-to-all on the busiest rank {off.a2a_s * 1e3:.3f} ms a step, of it {on.a2a_hidden_s * 1e3:.3f} ms "
                f"hidden behind compute ({'chose it' if self.overlap else 'not chosen'})"]

    def __str__(self) -> str:
        return self.table()


def stages_text(stages: tuple[int, ...]) -> str:
    return ",".join(map(str, stages))


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
