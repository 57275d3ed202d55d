"""``fuse_backwards`` (schedules/fuse.py, Note [fused where free]): an ``I`` directly followed by
its ``W`` becomes one ``B`` wherever the simulated timeline does not use the split."""

from __future__ import annotations

import pytest

from mpmd.runtime import PipelineConfig, build_schedule
from schedules import (Costs, Kind, Schedule, fuse_backwards, get_schedule, lower, simulate, simulate_blocking,
                       validate)

SPLIT = ("zb-h1", "zb-h2", "zbv", "dualpipev")


def _cases():
    for name in SPLIT:
        for p in (1, 2, 3, 4, 8):
            for m in (2 * p, 3 * p + 1):
                yield name, p, m


def _split(sched: Schedule) -> set:
    return {(a.stage, a.microbatch) for acts in sched.ranks for a in acts if a.kind is Kind.I}


@pytest.mark.parametrize("name,p,m", list(_cases()))
def test_fusing_moves_nothing_in_the_timeline(name, p, m):
    paper = get_schedule(name, p, m)
    fused = validate(fuse_backwards(paper))
    before, after = simulate(paper), simulate(fused)
    assert after.makespan == before.makespan and after.peak_activations == before.peak_activations
    for a, t in after.start.items():
        if a.kind is Kind.B:  # one pair: it starts with its I and ends with its W
            assert t == before.start[a._replace(kind=Kind.I)]
            assert after.end[a] == before.end[a._replace(kind=Kind.W)]
        else:
            assert t == before.start[a] and after.end[a] == before.end[a], a
    assert fused.ranks != paper.ranks and _split(fused) < _split(paper)
    for r, acts in enumerate(fused.ranks):  # what stays split is what the generator wrote
        assert [a for a in acts if a.kind is not Kind.B] == [a for a in paper.ranks[r]
                                                             if (a.stage, a.microbatch) in _split(fused)
                                                             or a.kind is Kind.F], r
    simulate_blocking(lower(fused))  # lowered, it still cannot deadlock


def test_dualpipev_fuses_its_steady_state_and_splits_where_the_gradient_is_awaited():
    fused = fuse_backwards(get_schedule("dualpipev", 2, 8))
    assert [str(a) for a in fused.ranks[0]] == (
        "0F0 0F1 0F2 3F0 3B0 3F1 0F3 3B1 3F2 0B0 0F4 3B2 3F3 0B1 0F5 3B3 3F4 0B2 0F6 3B4 3F5 0B3 0F7 3B5 3F6 "
        "0B4 3B6 3F7 0B5 3B7 0B6 0B7").split()
    # Rank 1's drain: rank 0 waits for 1I5, 1I6, 1I7's gradients as soon as they are there.
    assert _split(fused) == {(1, 5), (1, 6), (1, 7), (2, 7)}


def test_the_first_stage_always_fuses_and_an_awaited_gradient_never_does():
    sched = Schedule.from_text(["0F0 0I0 0W0", "1F0 1I0 1W0"])
    fused = fuse_backwards(sched)
    assert [str(a) for a in fused.ranks[0]] == ["0F0", "0B0"]  # nothing consumes stage 0's input gradient
    assert [str(a) for a in fused.ranks[1]] == ["1F0", "1I0", "1W0"]  # 0B0 starts when 1I0 ends
    # With the hop longer than W, the consumer still waits on the split's earlier gradient.
    assert fuse_backwards(sched, Costs(comm=2.0)).ranks[1] == sched.ranks[1]


def test_the_costs_decide_where_the_consumer_has_slack():
    sched = Schedule.from_text(["0F0 0F1 0I0 0W0 0I1 0W1", "1F0 1I0 1W0 1F1 1I1 1W1"])
    # Unit costs: 0I0 starts at 3, as soon as 1I0's gradient is there.
    assert _split(fuse_backwards(sched)) == {(1, 0), (1, 1)}
    # A slow stage 0: rank 0 is still in 0F1 (3..6) when 1I0 ends at 5, so 1W0 fits before 0I0
    # starts; 0I1 starts at 8, as soon as 1I1 ends.
    slow = Costs(f=(3.0, 1.0))
    fused = fuse_backwards(sched, slow)
    assert _split(fused) == {(1, 1)} and [str(a) for a in fused.ranks[1]] == "1F0 1B0 1F1 1I1 1W1".split()
    assert simulate(fused, slow).makespan == simulate(sched, slow).makespan
    assert fuse_backwards(fused, slow) == fused


def test_build_schedule_fuses_named_schedules_and_keeps_given_ones():
    cfg = PipelineConfig.from_options(num_actors=2)
    named = build_schedule("dualpipev", 4, cfg, 8)
    assert named.ranks == fuse_backwards(get_schedule("dualpipev", 2, 8)).ranks and named.name == "dualpipev"
    paper = get_schedule("dualpipev", 2, 8)
    assert build_schedule(paper, 4, cfg, 8).ranks == paper.ranks
    assert build_schedule("1f1b", 2, cfg, 8).ranks == get_schedule("1f1b", 2, 8).ranks  # nothing to fuse
