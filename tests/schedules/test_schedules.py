"""Tests for the schedule language (schedules/): text form, generators, validation,
the cost-model simulator, lowering passes and the blocking (deadlock) check.

Single process, no torch, no ray; the whole file runs in about a second.
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

import schedules
from schedules import (
    Action,
    Costs,
    Kind,
    Schedule,
    get_schedule,
    lower,
    schedule_names,
    simulate,
    validate,
)

from .sweep import SWEEP, built, case_id  # noqa: F401  (built is a fixture)


def test_sweep_covers_edges():
    names = {c[0] for c in SWEEP}
    assert names == {"gpipe", "1f1b", "interleaved-1f1b"}
    # m == p and m == 1 for every generator where allowed, and p = 8 at least twice.
    for name in names:
        assert any(c[0] == name and c[1] == c[2] > 1 for c in SWEEP)
        assert any(c[0] == name and c[2] == 1 for c in SWEEP)
        assert sum(c[0] == name and c[1] == 8 for c in SWEEP) >= 1
    assert ("interleaved-1f1b", 8, 8, 3) in SWEEP


# -- text form ---------------------------------------------------------------------------------


_INDEX = {Kind.FILL: "fill_slot", Kind.TIE_REDUCE: "tie_group"}  # the rest name a microbatch, ALLREDUCE none


@pytest.mark.parametrize("kind", [k for k in Kind if k is not Kind.OVERLAP], ids=lambda k: k.value)
def test_action_text_round_trip(kind):  # OVERLAP, a composite: tests/schedules/test_overlap.py
    field = _INDEX.get(kind, "microbatch")
    a = Action(12, kind) if kind is Kind.ALLREDUCE else Action(12, kind, **{field: 7})
    text = repr(a)
    assert text == (f"12{kind.value}" if kind is Kind.ALLREDUCE else f"12{kind.value}7")
    assert str(a) == text
    assert Action.parse(text) == a
    assert Action.parse(f"  {text} ") == a
    assert Action.parse(text).kind is kind
    if kind is not Kind.ALLREDUCE:  # the number lands in the kind's own field, the others stay None
        parsed = Action.parse(text)
        assert {f: getattr(parsed, f) for f in ("microbatch", *_INDEX.values())} == {
            f: 7 if f == field else None for f in ("microbatch", *_INDEX.values())}


def test_a_fill_slot_or_tie_group_is_not_a_microbatch():
    with pytest.raises(ValueError, match=r"FILL takes no microbatch; write Action\(0, Kind.FILL, fill_slot=3\)"):
        Action(0, Kind.FILL, 3)
    with pytest.raises(ValueError, match=r"F takes no tie_group; write Action\(1, Kind.F, microbatch=0\)"):
        Action(1, Kind.F, tie_group=0)
    with pytest.raises(ValueError, match=r"ALLREDUCE takes no fill_slot"):
        Action(1, Kind.ALLREDUCE, fill_slot=0)
    # A schedule's microbatch count comes from its microbatches alone, not its slots or groups.
    lowered = Schedule.from_text(["0F0 0SEND_F0 0RECV_B0 0FILL5 0B0 0FREE0 0TIE_REDUCE4",
                                  "1RECV_F0 1F0 1B0 1SEND_B0 1FREE0 1TIE_REDUCE4"])
    assert lowered.num_microbatches == 1


def test_action_text_examples():
    assert repr(Action(1, Kind.F, 0)) == "1F0"
    assert Action.parse("2SEND_B3") == Action(2, Kind.SEND_B, 3)
    assert Action.parse("1ALLREDUCE") == Action(1, Kind.ALLREDUCE, None)
    assert Action.parse("0B10") == Action(0, Kind.B, 10)


@pytest.mark.parametrize(
    "text, match",
    [
        ("1X0", r"cannot parse action '1X0'.*kind one of F, B"),
        ("F0", r"cannot parse action 'F0'"),
        ("1F", r"cannot parse action '1F': F needs a microbatch index"),
        ("1ALLREDUCE3", r"ALLREDUCE takes no microbatch, write '1ALLREDUCE'"),
        ("", r"cannot parse action ''"),
        ("1SEND_X0", r"cannot parse action '1SEND_X0'"),
    ],
)
def test_action_parse_rejects_malformed(text, match):
    with pytest.raises(ValueError, match=match):
        Action.parse(text)


@pytest.mark.parametrize(
    "case",
    [("gpipe", 3, 5, None), ("1f1b", 4, 8, None), ("1f1b", 8, 3, None), ("interleaved-1f1b", 2, 4, 3)],
    ids=case_id,
)
def test_schedule_text_round_trip(case):
    s = get_schedule(*case)
    back = Schedule.from_text(s.to_text())
    assert back.ranks == s.ranks
    assert back.stage_to_rank == s.stage_to_rank
    assert back.num_microbatches == s.num_microbatches
    # Lines labelled "rank r:" (as render_order prints them) and a list of lines parse too.
    labelled = "\n".join(f"rank {r}: " + " ".join(map(repr, acts)) for r, acts in enumerate(s.ranks))
    assert Schedule.from_text(labelled).ranks == s.ranks
    assert Schedule.from_text(s.to_text().splitlines()).ranks == s.ranks
    # A lowered program round-trips as well.
    lowered = lower(s, allreduce=True)
    assert Schedule.from_text(lowered.to_text()).ranks == lowered.ranks


def test_schedule_from_text_rejects_malformed():
    with pytest.raises(ValueError, match="schedule text is empty"):
        Schedule.from_text("")
    with pytest.raises(ValueError, match=r"cannot parse action '0X0'"):
        Schedule.from_text("0F0 0X0")


# -- golden renders -----------------------------------------------------------------------------

GOLDEN_GPIPE_2_2 = """\
rank 0: 0F0 0F1 ... ... ... 0B0 0B0 0B1 0B1
rank 1: ... 1F0 1F1 1B0 1B0 1B1 1B1 ... ..."""

GOLDEN_1F1B_3_4 = """\
rank 0: 0F0 0F1 0F2 ... ... ... ... 0B0 0B0 0F3 0B1 0B1 ... 0B2 0B2 ... 0B3 0B3
rank 1: ... 1F0 1F1 ... ... 1B0 1B0 1F2 1B1 1B1 1F3 1B2 1B2 ... 1B3 1B3 ... ...
rank 2: ... ... 2F0 2B0 2B0 2F1 2B1 2B1 2F2 2B2 2B2 2F3 2B3 2B3 ... ... ... ..."""

GOLDEN_INTERLEAVED_2_4_2 = """\
rank 0: 0F0 0F1 2F0 2F1 0F2 ... 2B0 2B0 0F3 2B1 2B1 2F2 0B0 0B0 2F3 0B1 0B1 ... 2B2 2B2 ... 2B3 2B3 0B2 0B2 0B3 0B3
rank 1: ... 1F0 1F1 3F0 3B0 3B0 3F1 3B1 3B1 1F2 1B0 1B0 1F3 1B1 1B1 3F2 3B2 3B2 3F3 3B3 3B3 1B2 1B2 1B3 1B3 ... ..."""


@pytest.mark.parametrize(
    "case, golden",
    [
        (("gpipe", 2, 2, None), GOLDEN_GPIPE_2_2),
        (("1f1b", 3, 4, None), GOLDEN_1F1B_3_4),
        (("interleaved-1f1b", 2, 4, 2), GOLDEN_INTERLEAVED_2_4_2),
    ],
    ids=["gpipe-2-2", "1f1b-3-4", "interleaved-2-4-2"],
)
def test_golden_render(case, golden):
    s = get_schedule(*case)
    assert s.render() == golden
    assert str(s) == golden


def test_render_falls_back_to_program_order():
    s = get_schedule("1f1b", 2, 2)
    # Non-integer times cannot be drawn on a unit grid: program order is shown instead.
    assert s.render(costs=Costs(comm=0.5)) == schedules.render_order(s)
    assert schedules.render_order(s, mark=(1, 2)) == (
        "rank 0:  0F0  0F1  0B0  0B1\n"
        "rank 1:  1F0  1B0 [1F1] 1B1"
    )


# -- generators and validation -----------------------------------------------------------------


@pytest.mark.parametrize("case", SWEEP, ids=case_id)
def test_generator_is_valid(case, built):
    name, p, m, v = case
    s = built[case][0]
    assert validate(s) is s
    assert s.num_ranks == p and s.num_microbatches == m
    assert s.num_stages == p * (v or 1)
    assert s.stage_to_rank == tuple(st % p for st in range(p * (v or 1)))
    counts = Counter(a for acts in s.ranks for a in acts)
    expected = {Action(st, k, mb) for st in range(s.num_stages) for mb in range(m) for k in (Kind.F, Kind.B)}
    assert set(counts) == expected
    assert all(c == 1 for c in counts.values())
    for r, acts in enumerate(s.ranks):
        assert all(s.stage_to_rank[a.stage] == r for a in acts)


def test_impossible_combinations_raise():
    for p in (2, 3, 4, 8):
        for m in range(1, 13):
            if m % p:
                with pytest.raises(ValueError, match="divisible"):
                    get_schedule("interleaved-1f1b", p, m, 2)
    for name in ("gpipe", "1f1b"):
        for v in (2, 3):
            with pytest.raises(ValueError, match=rf"{name} needs stages_per_rank = 1, got {v}"):
                get_schedule(name, 2, 4, v)


# -- simulator ---------------------------------------------------------------------------------


@pytest.mark.parametrize("case", SWEEP, ids=case_id)
def test_unit_cost_bubble_and_peak(case, built):
    name, p, m, v = case
    res = simulate(built[case][0])
    if name == "interleaved-1f1b":
        expected = (p - 1) / (v * m + p - 1)
    else:
        expected = (p - 1) / (m + p - 1)
    assert res.bubble_fraction == pytest.approx(expected, abs=1e-12)
    # Unit costs: F = 1, B = b + w = 2 per (virtual) stage and microbatch.
    assert max(res.busy) == 3 * m * (v or 1)
    assert res.makespan == pytest.approx(max(res.busy) / (1 - expected), abs=1e-9)
    if name == "gpipe":
        assert res.peak_activations[0] == m
        assert res.peak_activations == (m,) * p
    elif name == "1f1b":
        assert res.peak_activations[0] == min(p, m)
        assert res.peak_activations == tuple(min(p - r, m) for r in range(p))


def test_simulate_with_comm_hand_computed():
    # 1F1B, p=2, m=2, f=b=w=1 (B costs 2), one hop costs 0.5:
    #   rank 0: 0F0 [0,1] 0F1 [1,2]                 0B0 [5,7]    0B1 [8,10]
    #   rank 1:      1F0 [1.5,2.5] 1B0 [2.5,4.5] 1F1 [4.5,5.5] 1B1 [5.5,7.5]
    s = get_schedule("1f1b", 2, 2)
    res = simulate(s, Costs(f=1, b=1, w=1, comm=0.5))
    A = Action.parse
    assert res.start == {
        A("0F0"): 0.0, A("0F1"): 1.0, A("1F0"): 1.5, A("1B0"): 2.5,
        A("1F1"): 4.5, A("1B1"): 5.5, A("0B0"): 5.0, A("0B1"): 8.0,
    }
    assert res.end[A("0B1")] == 10.0
    assert res.makespan == 10.0
    assert res.busy == (6.0, 6.0)
    assert res.idle == (4.0, 4.0)
    assert res.bubble_fraction == pytest.approx(0.4, abs=1e-12)
    assert res.bubble_time == pytest.approx(4.0)


def test_simulate_per_stage_cost_lists():
    # Stage 0: F=1, B=1+0.5; stage 1: F=2, B=2+0.5; comm=0.5.
    #   rank 0: 0F0 [0,1] 0F1 [1,2]                         0B0 [6.5,8]  0B1 [11,12.5]
    #   rank 1:      1F0 [1.5,3.5] 1B0 [3.5,6] 1F1 [6,8] 1B1 [8,10.5]
    s = get_schedule("1f1b", 2, 2)
    res = simulate(s, Costs(f=[1, 2], b=[1, 2], w=[0.5, 0.5], comm=0.5))
    A = Action.parse
    assert res.start[A("1F0")] == 1.5
    assert res.start[A("1F1")] == 6.0
    assert res.start[A("0B0")] == 6.5
    assert res.start[A("0B1")] == 11.0
    assert res.makespan == 12.5
    assert res.busy == (5.0, 9.0)
    assert res.bubble_fraction == pytest.approx(1 - 9 / 12.5, abs=1e-12)


def test_simulate_split_backward():
    # Zero-bubble style split on one rank: I costs b, W costs w, W waits for its I.
    s = Schedule.from_text("0F0 1F0 1I0 0I0 1W0 0W0", stage_to_rank=[0, 0])
    res = simulate(s, Costs(f=1, b=2, w=3))
    assert res.makespan == 1 + 1 + 2 + 2 + 3 + 3
    assert res.peak_activations == (2,)


def test_costs_reject_bad_values():
    with pytest.raises(ValueError, match=r"Costs.f must be finite and >= 0"):
        Costs(f=-1)
    with pytest.raises(ValueError, match=r"Costs.comm must be finite and >= 0"):
        Costs(comm=float("inf"))
    with pytest.raises(ValueError, match=r"Costs.f has 2 values but the schedule has stage 2"):
        simulate(get_schedule("1f1b", 3, 2), Costs(f=[1, 2]))


# -- bad inputs --------------------------------------------------------------------------------


def test_unknown_schedule_name_lists_registered():
    names = schedule_names()
    assert {"gpipe", "1f1b", "interleaved-1f1b"} <= set(names)
    with pytest.raises(ValueError, match=r"unknown schedule 'nope'; registered schedules: .*1f1b.*gpipe"):
        get_schedule("nope", 2, 4)
    with pytest.raises(ValueError, match=re.escape(", ".join(names))):
        schedules.schedule_info("nope")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_ranks=0, num_microbatches=4), r"num_ranks must be a positive integer, got 0"),
        (dict(num_ranks=-2, num_microbatches=4), r"num_ranks must be a positive integer, got -2"),
        (dict(num_ranks=2, num_microbatches=0), r"num_microbatches must be a positive integer, got 0"),
        (dict(num_ranks=2, num_microbatches=-1), r"num_microbatches must be a positive integer, got -1"),
        (dict(num_ranks=2, num_microbatches=4, stages_per_rank=0), r"stages_per_rank must be a positive integer, got 0"),
        (dict(num_ranks=2.0, num_microbatches=4), r"num_ranks must be a positive integer, got 2.0"),
        (dict(num_ranks=True, num_microbatches=4), r"num_ranks must be a positive integer, got True"),
    ],
)
def test_bad_counts(kwargs, match):
    for name in ("gpipe", "1f1b", "interleaved-1f1b"):
        with pytest.raises(ValueError, match=match):
            get_schedule(name, **kwargs)


def test_interleaved_needs_divisible_microbatches():
    with pytest.raises(ValueError, match=r"num_microbatches \(6\) must be divisible by num_ranks \(4\).*use 4, 8, 12"):
        get_schedule("interleaved-1f1b", 4, 6)


def test_gpipe_refuses_several_stages_per_rank():
    with pytest.raises(ValueError, match=r"gpipe needs stages_per_rank = 1, got 2 \(use interleaved-1f1b"):
        get_schedule("gpipe", 2, 4, stages_per_rank=2)


@pytest.mark.parametrize(
    "text, match",
    [
        # A forward without its backward.
        ("0F0 0B0\n1F0", r"stage 1, microbatch 0 has no B \(or I and W\) on rank 1"),
        # I without W.
        ("0F0 0B0\n1F0 1I0", r"stage 1, microbatch 0 has no W on rank 1"),
        # B mixed with I/W for one (stage, microbatch).
        ("0F0 0B0\n1F0 1B0 1W0", r"has both B and I/W"),
        # A compute action on a rank that does not own its stage.
        ("0F0 1B0\n1F0 0B0", r"rank 0, position 1: 1B0 runs on rank 0, but stage 1 lives on rank 1"),
        # A duplicated action.
        ("0F0 0B0 0B0\n1F0 1B0", r"rank 0, position 2: 0B0 appears twice"),
        # Rank 1 runs its backward before its forward.
        ("0F0 0B0\n1B0 1F0", r"cannot finish(.|\n)*rank 1, position 0: 1B0 waits for 1F0"),
        # An order cycle across ranks: 0B0 waits for 1B0, which waits (via 1F1) for 0F1.
        ("0F0 0B0 0F1 0B1\n1F1 1B1 1F0 1B0", r"cannot finish(.|\n)*rank 0, position 1: 0B0 waits for 1B0"),
        # A forward whose stage is missing.
        ("0F0 0B0\n2F0 2B0", r"stage 1 has no forward action on any rank"),
        # Forwards of one stage on two ranks.
        ("0F0 0B0 0F1 0B1\n0F1", r"stage 0 has forwards on rank 0 and rank 1"),
        # No forwards at all.
        ("0B0", r"no forward \(F\) actions"),
    ],
)
def test_user_schedule_rejected(text, match):
    with pytest.raises(ValueError, match=match):
        Schedule.from_text(text)


def test_user_schedule_out_of_range():
    with pytest.raises(ValueError, match=r"names microbatch 3, but microbatches are 0..1"):
        Schedule.from_text("0F0 0B0 0F1 0B1 0F3 0B3", num_microbatches=2)
    with pytest.raises(ValueError, match=r"stage_to_rank maps stage 1 to rank 5"):
        Schedule.from_text("0F0 0B0\n1F0 1B0", stage_to_rank=[0, 5])
    with pytest.raises(ValueError, match=r"num_microbatches must be >= 1"):
        Schedule(((Action.parse("0F0"),),), 0, (0,))


def test_user_schedule_accepted_and_simulated():
    s = Schedule.from_lists([["0F0", "0F1", "0B0", "0B1"], [Action(1, Kind.F, 0), "1B0", "1F1", "1B1"]], name="mine")
    assert s.name == "mine"
    assert s.stage_to_rank == (0, 1)
    assert s.num_microbatches == 2
    assert s.ranks == get_schedule("1f1b", 2, 2).ranks
    assert simulate(s).bubble_fraction == pytest.approx(1 / 3, abs=1e-12)


def test_one_stage_may_fuse_some_backwards_and_split_others():
    s = Schedule.from_text(["0F0 0F1 0I0 0W0 0B1", "1F0 1I0 1W0 1F1 1B1"])
    assert s.backward_of(1, 0) is Kind.I and s.backward_of(1, 1) is Kind.B
    assert s.backward_kind == {0: Kind.I, 1: Kind.I}  # some backward of the stage is split
    res = simulate(s)  # unit costs, a fused B costs b + w
    assert res.start[Action(0, Kind.I, 0)] == 3  # waits for 1I0, not for its W
    assert res.start[Action(1, Kind.B, 1)] == 5 and res.end[Action(1, Kind.B, 1)] == 7
    assert res.start[Action(0, Kind.B, 1)] == 7 and res.makespan == 9
    with pytest.raises(ValueError, match="has both B and I/W"):
        Schedule.from_text(["0F0 0I0 0B0 0W0", "1F0 1B0"])
