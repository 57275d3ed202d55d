"""The cost model under ZeRO-1: the ALLREDUCE is a reduce-scatter (half a ring all-reduce) and
each rank all-gathers its stages' parameters after its optimizer step (Note [runtime costs])."""

from __future__ import annotations

import dataclasses

import pytest

import schedules
from schedules import Costs


def test_zero1_charges_a_reduce_scatter_and_an_all_gather():
    base = Costs(f=1.0, b=1.0, w=1.0, dp=2, grad_bytes=100.0, allreduce_bandwidth=100.0)
    zero = dataclasses.replace(base, zero=1)
    assert base.allreduce(0) == pytest.approx(1.0) and base.allgather(0) == 0.0
    assert zero.allreduce(0) == pytest.approx(0.5) and zero.allgather(0) == pytest.approx(0.5)
    lowered = schedules.lower(schedules.get_schedule("1f1b", 2, 4), allreduce=True)
    half = dataclasses.replace(base, grad_bytes=50.0)  # the same reduce-scatter time, no all-gather
    assert schedules.simulate(lowered, zero).step_time == pytest.approx(
        schedules.simulate(lowered, half).step_time + 0.5)


def test_zero_must_be_0_or_1_in_costs():
    with pytest.raises(ValueError, match="Costs.zero must be 0 or 1"):
        Costs(zero=2)
