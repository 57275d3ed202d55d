"""Peak memory of a schedule with OVERLAP actions (mpmd/planning/memory.py): an OVERLAP's
backward runs beside its forward, so the forward's temporaries add to the backward's peak."""

from __future__ import annotations

import dataclasses

import schedules
from mpmd.planning import StageCost, rank_memory

COSTS = [StageCost(f=1.0, b=1.0, w=1.0, act_bytes=100 * (s + 1), param_bytes=10, b_peak=50, i_peak=40)
         for s in range(4)]


def test_an_overlap_holds_its_forwards_temporaries_while_its_backward_peaks():
    plain = schedules.fuse_backwards(schedules.get_schedule("dualpipev", 2, 6))
    paired = schedules.fuse_backwards(schedules.get_schedule("dualpipev", 2, 6, overlap=True))
    assert rank_memory(paired, COSTS, 2.0) == rank_memory(plain, COSTS, 2.0)  # no temporaries: the same walk
    hot = [dataclasses.replace(c, f_peak=1000) for c in COSTS]
    by_plain, by_paired = rank_memory(plain, hot, 2.0), rank_memory(paired, hot, 2.0)
    assert all(p > q for p, q in zip(by_paired, by_plain))
    # an OVERLAP of F(s) then B(t): the peak of B(t) plus the forward's 1000 bytes of temporaries
    s = schedules.Schedule.from_text("0F0 0F1+0B0 0B1")
    one = [dataclasses.replace(COSTS[0], f_peak=1000)]
    params = 10 * (2.0 + 2.0)
    assert rank_memory(s, one, 2.0)[0] == params + 100 + 100 + 50 + 1000
    assert rank_memory(schedules.Schedule.from_text("0F0 0F1 0B0 0B1"), one, 2.0)[0] == params + 100 + 100 + 1000
