"""The profiler: ``pipe.profile(inputs, targets)`` measures dispatch, per-actor busy /
comm-wait / idle time and the bubble against the simulator (docs/profiling.md).

    run.py     profiled steps on a running pipeline, clock alignment
    report.py  ProfileReport and build_report (pure: no Ray), the measured task costs
    calibrate.py  the calibrated cost model (every runtime term of schedules.Costs; pure)
    trace.py   exporters: Chrome trace-event JSON, a PNG timeline
    slices.py  one executed instruction on the controller's clock, and the time kinds
    split.py   where each actor's step goes: compute, wait, comm, data, optimizer, own overhead
    exchanges.py  the expert all-to-alls: in flight, blocked and hidden behind compute
"""

from .exchanges import A2AHiding
from .calibrate import HeldOut, calibrated_costs, held_out, lowered_from_programs
from .report import ProfileReport, StepRecord, build_report, format_table, measured_costs
from .run import calibrate_pipeline, clock_offsets, message_bytes, probe_links, profile_pipeline
from .slices import COMM, COMPUTE, OPT, Slice
from .split import ActorSplit, KindOwn

__all__ = ["ProfileReport", "StepRecord", "Slice", "build_report", "measured_costs", "calibrated_costs", "lowered_from_programs", "held_out", "HeldOut", "format_table",
           "profile_pipeline", "calibrate_pipeline", "clock_offsets", "message_bytes", "probe_links", "COMPUTE", "COMM",
           "OPT", "ActorSplit", "KindOwn", "A2AHiding"]
