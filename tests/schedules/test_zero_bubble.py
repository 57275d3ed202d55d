"""Tests for the zero-bubble generators (schedules/zero_bubble.py): zb-h1, zb-h2, zbv, dualpipev."""

from __future__ import annotations

import pytest

import schedules
from schedules import Costs, Kind, get_schedule, lower, schedule_info, simulate, simulate_blocking, v_stage_to_rank

UNIT = Costs(f=1.0, b=1.0, w=1.0, comm=0.0)
NEW = ("zb-h1", "zb-h2", "zbv", "dualpipev")
SWEEP_RANKS = (1, 2, 3, 4, 8)
SWEEP_MICROBATCHES = range(1, 25)


def _min_microbatches(name: str, p: int) -> int:
    return {"zb-h2": 2 * p - 1, "dualpipev": 2 * p}.get(name, 1)


def _sweep():
    for name in NEW:
        for p in SWEEP_RANKS:
            for m in SWEEP_MICROBATCHES:
                if m >= _min_microbatches(name, p):
                    yield name, p, m


def test_registered_with_stage_maps():
    names = schedules.schedule_names()
    for name in NEW:
        assert name in names
    assert schedule_info("zb-h1").default_stages_per_rank == 1
    assert schedule_info("zb-h2").default_stages_per_rank == 1
    for name in ("zbv", "dualpipev"):
        info = schedule_info(name)
        assert info.default_stages_per_rank == 2 and info.allowed_stages_per_rank == (2,)
        assert get_schedule(name, 4, 8).stage_to_rank == v_stage_to_rank(4) == (0, 1, 2, 3, 3, 2, 1, 0)


def test_zb_h1_bubble_is_a_third_of_1f1b_with_the_same_memory():
    p, m = 4, 8
    zb = simulate(get_schedule("zb-h1", p, m), UNIT)
    base = simulate(get_schedule("1f1b", p, m), UNIT)
    assert base.bubble_time == (p - 1) * (1 + 1 + 1) == 9
    assert zb.bubble_time == (p - 1) * (1 + 1 - 1) == 3
    assert zb.bubble_time == base.bubble_time / 3
    assert zb.busy == base.busy
    assert zb.peak_activations == base.peak_activations == (4, 3, 2, 1)


@pytest.mark.parametrize("f,b,w", [(1, 1, 1), (2, 2, 1), (1, 2, 1), (2, 1, 1), (1, 1, 0.5)])
@pytest.mark.parametrize("p,m", [(4, 8), (8, 24), (3, 5)])
def test_zb_h1_bubble_formula_when_w_at_most_f(f, b, w, p, m):
    res = simulate(get_schedule("zb-h1", p, m), Costs(f=f, b=b, w=w))
    assert res.bubble_time == pytest.approx((p - 1) * (f + b - w), abs=1e-12)


@pytest.mark.parametrize("p", SWEEP_RANKS)
def test_zb_h1_peak_activations_match_1f1b(p):
    for m in SWEEP_MICROBATCHES:
        zb = simulate(get_schedule("zb-h1", p, m))
        base = simulate(get_schedule("1f1b", p, m))
        assert zb.peak_activations == base.peak_activations, (p, m)


def test_zb_h2_has_no_bubble():
    res = simulate(get_schedule("zb-h2", 4, 8), UNIT)
    assert abs(res.bubble_fraction) < 1e-12
    assert res.makespan == max(res.busy) == 24
    assert res.peak_activations == (7, 5, 3, 1)  # 2(p-r)-1 in flight


@pytest.mark.parametrize("p", SWEEP_RANKS)
def test_zb_h2_no_bubble_for_every_allowed_m(p):
    for m in range(2 * p - 1, 25):
        assert abs(simulate(get_schedule("zb-h2", p, m), UNIT).bubble_fraction) < 1e-12, (p, m)


def test_zbv_bubble_no_larger_than_zb_h1():
    zbv = simulate(get_schedule("zbv", 4, 8), UNIT)
    h1 = simulate(get_schedule("zb-h1", 4, 8), UNIT)
    assert zbv.bubble_time <= h1.bubble_time
    assert zbv.bubble_time == 0
    # Two half-size chunks per rank: 2p chunk activations is 1F1B's p full stages.
    assert zbv.peak_activations == (8, 8, 8, 8)


def test_zbv_takes_any_microbatch_count():
    for m in (1, 2, 3, 5, 7):
        sched = get_schedule("zbv", 4, m)
        assert sched.num_microbatches == m


def test_dualpipev_beats_1f1b():
    dpv = simulate(get_schedule("dualpipev", 4, 8), UNIT)
    base = simulate(get_schedule("1f1b", 4, 8), UNIT)
    assert dpv.bubble_time < base.bubble_time
    assert dpv.bubble_fraction < base.bubble_fraction


@pytest.mark.parametrize("name,p,m", list(_sweep()))
def test_generated_lowered_and_blocking_simulated(name, p, m):
    sched = get_schedule(name, p, m)  # validates
    assert sched.name == name and sched.num_ranks == p
    for r, acts in enumerate(sched.ranks):
        kinds = {a.kind for a in acts}
        assert Kind.B not in kinds, "every backward is split into I and W"
        pos = {a: i for i, a in enumerate(acts)}
        for a in acts:
            if a.kind is Kind.W:
                assert pos[a._replace(kind=Kind.I)] < pos[a], (r, a)
    skewed = Costs(f=1, b=2, w=1, comm=0.5)
    for lowered in (lower(sched), lower(sched, allreduce=True), lower(sched, costs=skewed)):
        res = simulate_blocking(lowered)
        assert res.transfers == sum(a.kind in (Kind.SEND_F, Kind.SEND_B) for acts in lowered.ranks for a in acts)


def test_zb_h2_needs_enough_microbatches():
    with pytest.raises(ValueError, match=r"zb-h2 needs num_microbatches >= 2\*num_ranks - 1 = 7 for 4 ranks, got 6"):
        get_schedule("zb-h2", 4, 6)


def test_dualpipev_needs_enough_microbatches():
    with pytest.raises(ValueError, match=r"dualpipev needs num_microbatches >= 2\*num_ranks = 8 for 4 ranks, got 7.*zbv"):
        get_schedule("dualpipev", 4, 7)


@pytest.mark.parametrize("name,v", [("zb-h1", 2), ("zb-h2", 2), ("zbv", 1), ("zbv", 3), ("dualpipev", 1)])
def test_wrong_stages_per_rank(name, v):
    with pytest.raises(ValueError, match=rf"{name} needs stages_per_rank = \d, got {v}"):
        get_schedule(name, 4, 8, v)


@pytest.mark.parametrize("name,v", [("zb-h1", 2), ("zbv", 1), ("dualpipev", 3)])
def test_builders_check_stages_per_rank_when_called_directly(name, v):
    with pytest.raises(ValueError, match=rf"{name} needs stages_per_rank = \d, got {v}"):
        schedule_info(name).build(4, 8, v)
