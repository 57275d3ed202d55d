"""The cost model's tensor-parallel term (Note [runtime costs] in schedules/costs.py): a
TP rank computes 1/tp of the sharded share of a stage and pays ring all-reduces of the
activation in its forward and its input-gradient backward, none in W."""

from __future__ import annotations

import dataclasses

import pytest

from schedules import Action, Costs, Kind, get_schedule, lower, simulate

TP = dict(tp=2, tp_forward=2.0, tp_bytes=100.0, tp_bandwidth=100.0, tp_latency=0.1)


def test_tp_1_simulates_bit_for_bit_as_before():
    """With tp=1 every TP field is ignored: the same floats as a Costs without them."""
    for name in ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev"):
        s = get_schedule(name, 2, 4)
        plain = Costs(f=tuple(1.3 - 0.2 * i for i in range(s.num_stages)), b=2.1, w=0.4,
                      task=0.01, message=0.02, latency=0.03, bandwidth=1e3, activation_bytes=10.0, dp=2,
                      grad_bytes=50.0, allreduce_bandwidth=1e3)
        with_tp = dataclasses.replace(plain, **{**TP, "tp": 1}, tp_sharded=0.5)
        for sched in (s, lower(s, allreduce=True)):
            a, b = simulate(sched, plain), simulate(sched, with_tp)
            assert (a.makespan, a.step_time, a.end) == (b.makespan, b.step_time, b.end), name


def test_tp_collective_is_a_ring_all_reduce_per_collective():
    c = Costs(**TP)
    assert c.tp_collective(0) == pytest.approx(2 * (0.1 + 2 * (1 / 2) * 100 / 100))  # 2.2
    assert c.tp_collective(0, backward=True) == c.tp_collective(0)  # tp_backward None: as many as the forward
    four = dataclasses.replace(c, tp=4, tp_backward=(0.0, 2.0))
    assert four.tp_collective(0) == pytest.approx(2 * (0.1 + 2 * (3 / 4) * 1.0))
    assert four.tp_collective(0, backward=True) == 0.0 and four.tp_collective(1, backward=True) > 0
    assert Costs(**{**TP, "tp": 1}).tp_collective(0) == 0.0


def test_sharded_compute_divides_and_w_pays_no_collective():
    c = Costs(f=1.0, b=1.0, w=1.0, tp_sharded=0.5, **TP)  # a rank computes 1 - 0.5 + 0.5 / 2 = 0.75
    assert c.of(Action(0, Kind.F, 0)) == pytest.approx(0.75 + 2.2)
    assert c.of(Action(0, Kind.I, 0)) == pytest.approx(0.75 + 2.2)
    assert c.of(Action(0, Kind.W, 0)) == pytest.approx(0.75)
    assert c.of(Action(0, Kind.B, 0)) == pytest.approx(1.5 + 2.2)


def test_hand_computed_gpipe_makespan_under_tp_2():
    """GPipe, 2 stages, 2 microbatches: the makespan is 3 F + 3 B.  Unit f, b, w, all
    sharded, tp=2: F = 0.5 + 2 x 1.1 = 2.7 and B = (1 + 1) / 2 + 2.2 = 3.2, so 17.7;
    without TP F = 1, B = 2: 9."""
    s = get_schedule("gpipe", 2, 2)
    assert simulate(s, Costs(f=1.0, b=1.0, w=1.0)).makespan == pytest.approx(9.0)
    assert simulate(s, Costs(f=1.0, b=1.0, w=1.0, **TP)).makespan == pytest.approx(3 * 2.7 + 3 * 3.2)
    free = Costs(f=1.0, b=1.0, w=1.0, tp=2)  # no collectives: exactly half the compute
    assert simulate(s, free).makespan == pytest.approx(4.5)
    # The instruction-level simulator charges the same compute (and the transfers unchanged).
    assert simulate(lower(s), dataclasses.replace(free, task=1e-12)).makespan == pytest.approx(4.5, abs=1e-6)


@pytest.mark.parametrize("field,value,match", [
    ("tp", 0, "Costs.tp must be an int >= 1"),
    ("tp_sharded", 1.5, r"Costs.tp_sharded must be shares in \[0, 1\]"),
    ("tp_bandwidth", 0.0, "Costs.tp_bandwidth must be > 0"),
    ("tp_forward", -1.0, "Costs.tp_forward must be finite and >= 0"),
    ("tp_latency", -1.0, "Costs.tp_latency must be finite and >= 0"),
])
def test_tp_fields_are_checked(field, value, match):
    with pytest.raises(ValueError, match=match):
        Costs(**{field: value})
