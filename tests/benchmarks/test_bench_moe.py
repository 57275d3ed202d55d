"""``python -m mpmd bench moe``'s prediction, on costs given as data: the overlapped program
waits less on all-to-all and steps faster than the same schedule run forward then backward,
and on fewer cores than actors the actors' compute bounds the step."""

from __future__ import annotations

import pytest

import schedules
from schedules import Costs


def _lowered() -> dict:
    written = schedules.fuse_backwards(schedules.get_schedule("dualpipev", 2, 8, overlap=True))
    plain = schedules.Schedule(ranks=[tuple(schedules.flat(acts)) for acts in written.ranks],
                               num_microbatches=8, stage_to_rank=written.stage_to_rank)
    return {"overlap": schedules.lower(written), "plain": schedules.lower(plain)}


def test_the_prediction_hides_all_to_all_and_knows_shared_cores():
    from benchmarks.bench_moe import predicted

    costs = Costs(f=1.0, b=1.0, w=1.0, a2a_f=0.5, a2a_b=0.5)
    alone = predicted(costs, _lowered(), replicas=2, cores=4)  # a device per actor
    assert sum(alone["overlap"][1]) < sum(alone["plain"][1])  # exposed all-to-all per rank
    assert alone["overlap"][0] < alone["plain"][0] and alone["overlap"][0] == alone["overlap"][2]
    shared = predicted(costs, _lowered(), replicas=2, cores=1)  # 4 actors on one core: compute bound
    for key, (step, exposed, simulated) in shared.items():
        assert step > simulated
    assert shared["overlap"][0] == pytest.approx(shared["plain"][0])  # the same compute either way
