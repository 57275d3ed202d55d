"""The expert all-to-all terms of the calibrated cost model (Note [all-to-all costs] in
schedules/costs.py): recovered from a timeline the simulator recorded under known costs, and
what the calibrated model then predicts for the same schedule with OVERLAP actions."""

from __future__ import annotations

import dataclasses

import pytest

import schedules
from mpmd.profiler import Slice, calibrated_costs, lowered_from_programs

from .test_calibration import KNOWN, NS, STEP_OVERHEAD, recorded

EXPERTS = dataclasses.replace(KNOWN, a2a_f=(1e-3, 0.5e-3), a2a_b=(2e-3, 1e-3))


def _exchanges(slices, programs, costs):
    """An exchange slice ending with each F, B and I slice, as long as the model's all-to-all."""
    out = []
    for s in slices:
        if s.kind in ("F", "B", "I") and s.index >= 0:
            a = programs[s.actor][s.index].action
            out.append(Slice(s.actor, s.step, s.index, f"{a!r} dispatch", "A2A",
                             s.end_ns - round(costs.a2a(a) * NS), s.end_ns))
    return out


def test_calibration_recovers_the_all_to_alls_and_takes_them_out_of_the_computes():
    sched, programs, slices, windows, sim = recorded(EXPERTS)
    fitted = calibrated_costs(sched, programs, slices, windows, exchanges=_exchanges(slices, programs, EXPERTS))
    assert fitted.a2a_f == pytest.approx(EXPERTS.a2a_f, rel=1e-6) and fitted.a2a_b == pytest.approx(EXPERTS.a2a_b, rel=1e-6)
    assert fitted.f == pytest.approx(KNOWN.f, rel=1e-6) and fitted.b == pytest.approx(KNOWN.b, rel=1e-6)
    again = schedules.simulate(lowered_from_programs(sched, programs), fitted)
    assert again.step_time == pytest.approx(sim.step_time + STEP_OVERHEAD, rel=0.02)
    blind = calibrated_costs(sched, programs, slices, windows)  # without the exchanges: in the computes
    assert blind.a2a_f == (0.0, 0.0) and blind.f == pytest.approx([f + a for f, a in zip(KNOWN.f, EXPERTS.a2a_f)])
    # an OVERLAP of a forward and a backward costs both computes and the all-to-all neither hid
    pair = schedules.Action.parse("0F3+0B0")  # 1 ms of the forward's behind 4 ms, 2 ms of the backward's behind 2 ms
    assert fitted.of(pair) == pytest.approx(KNOWN.f[0] + KNOWN.b[0])
