"""Lowering passes and the blocking-rendezvous (deadlock) check; single process, fast."""

from __future__ import annotations

from collections import Counter

import pytest

from schedules import (
    COMPUTE_KINDS,
    Action,
    Costs,
    DeadlockError,
    Kind,
    Schedule,
    ScheduleError,
    add_allreduce,
    add_frees,
    add_send_recv,
    get_schedule,
    lower,
    simulate,
    simulate_blocking,
)

from .sweep import SWEEP, built, case_id  # noqa: F401  (built is a fixture)

SEND_TO_RECV = {Kind.SEND_F: (Kind.RECV_F, +1), Kind.SEND_B: (Kind.RECV_B, -1)}


# -- lowering ----------------------------------------------------------------------------------


def _check_lowered(compute: Schedule, lowered: Schedule, allreduce: bool) -> None:
    owner = compute.stage_to_rank
    # Same compute actions in the same per-rank order.
    for r, (before, after) in enumerate(zip(compute.ranks, lowered.ranks, strict=True)):
        assert [a for a in after if a.kind in COMPUTE_KINDS] == list(before), f"rank {r}"

    # Every send has exactly one matching receive on the peer, and nothing else is received.
    sends = Counter()
    recvs = Counter()
    for r, acts in enumerate(lowered.ranks):
        for a in acts:
            if a.kind in SEND_TO_RECV:
                assert owner[a.stage] == r
                recv_kind, step = SEND_TO_RECV[a.kind]
                sends[(owner[a.stage + step], Action(a.stage + step, recv_kind, a.microbatch))] += 1
            elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                assert owner[a.stage] == r
                recvs[(r, a)] += 1
    assert sends == recvs
    assert all(c == 1 for c in sends.values())
    # One transfer per cross-rank hop: forward and backward of each boundary and microbatch.
    hops = sum(owner[s] != owner[s + 1] for s in range(compute.num_stages - 1))
    assert sum(sends.values()) == 2 * hops * compute.num_microbatches

    # FREE(s, m) once per (stage, microbatch), on the owning rank, after its last use there.
    frees = Counter()
    for r, acts in enumerate(lowered.ranks):
        for i, a in enumerate(acts):
            if a.kind is Kind.FREE:
                assert owner[a.stage] == r
                frees[(a.stage, a.microbatch)] += 1
                later = [b for b in acts[i + 1:] if (b.stage, b.microbatch) == (a.stage, a.microbatch)]
                assert not later, f"rank {r}: {later} after {a!r}"
    assert set(frees) == {(s, m) for s in range(compute.num_stages) for m in range(compute.num_microbatches)}
    assert all(c == 1 for c in frees.values())

    # The DP all-reduce: once per stage, on its rank, after the stage's last backward.
    reduces = [(r, i, a) for r, acts in enumerate(lowered.ranks) for i, a in enumerate(acts) if a.kind is Kind.ALLREDUCE]
    if not allreduce:
        assert reduces == []
        return
    assert sorted(a.stage for _, _, a in reduces) == list(range(compute.num_stages))
    for r, i, a in reduces:
        assert owner[a.stage] == r
        assert not any(b.stage == a.stage and b.kind in COMPUTE_KINDS for b in lowered.ranks[r][i + 1:])


@pytest.mark.parametrize("case", SWEEP, ids=case_id)
def test_lowered_programs_finish(case, built):
    s, plain, with_ar = built[case]
    for lowered, allreduce in ((plain, False), (with_ar, True)):
        _check_lowered(s, lowered, allreduce)
        result = simulate_blocking(lowered)
        hops = sum(s.stage_to_rank[i] != s.stage_to_rank[i + 1] for i in range(s.num_stages - 1))
        assert result.transfers == 2 * hops * s.num_microbatches


def test_lower_is_the_composition_of_the_passes():
    s = get_schedule("interleaved-1f1b", 2, 4, 2)
    assert lower(s).ranks == add_frees(add_send_recv(s)).ranks
    assert lower(s, allreduce=True).ranks == add_frees(add_allreduce(add_send_recv(s))).ranks
    with pytest.raises(ValueError, match="already has send/recv actions"):
        add_send_recv(lower(s))


def test_add_send_recv_keeps_trailing_non_compute_actions_in_place():
    # ALLREDUCE and FREE added before send/recv ride with the compute before them,
    # also when several follow one compute (this once moved them to the start).
    s = get_schedule("1f1b", 2, 2)
    out = add_send_recv(add_frees(add_allreduce(s)))
    assert out.to_text() == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0FREE0 0RECV_B1 0B1 0FREE1 0ALLREDUCE\n"
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1FREE0 1F1 1B1 1SEND_B1 1FREE1 1ALLREDUCE"
    )
    simulate_blocking(out)


def test_lowered_golden_1f1b_2_2():
    s = get_schedule("1f1b", 2, 2)
    assert lower(s, allreduce=True).to_text() == (
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0FREE0 0RECV_B1 0B1 0FREE1 0ALLREDUCE\n"
        "1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1FREE0 1F1 1B1 1SEND_B1 1FREE1 1ALLREDUCE"
    )


# -- the blocking check ------------------------------------------------------------------------


def test_crossed_sends_deadlock_names_both_ranks():
    # Rank 0 sends its second activation while rank 1 sends its first gradient: with
    # rendezvous sends neither reaches the matching receive.
    crossed = Schedule.from_text(
        """
        0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1
        1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1
        """
    )
    with pytest.raises(DeadlockError) as info:
        simulate_blocking(crossed)
    msg = str(info.value)
    assert "deadlock" in msg
    assert "rank 0, position 3: stuck at 0SEND_F1 (waiting for rank 1)" in msg
    assert "rank 1, position 3: stuck at 1SEND_B0 (waiting for rank 0)" in msg
    assert "[0SEND_F1]" in msg  # the grid marks the failing cell
    assert isinstance(info.value, ValueError)
    # The same compute order, lowered by the pass, finishes.
    fixed = lower(Schedule.from_text("0F0 0F1 0B0 0B1\n1F0 1B0 1F1 1B1"))
    assert simulate_blocking(fixed).transfers == 4


def test_blocking_reports_mismatched_messages():
    # Rank 0 sends microbatch 1 first while rank 1 expects microbatch 0 on that channel.
    wrong = Schedule(
        (
            tuple(map(Action.parse, "0F0 0F1 0SEND_F1 0SEND_F0 0RECV_B0 0B0 0RECV_B1 0B1".split())),
            tuple(map(Action.parse, "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1".split())),
        ),
        2,
        (0, 1),
    )
    with pytest.raises(ScheduleError, match=r"rank 0 sends 0SEND_F1 while rank 1 expects 1RECV_F0"):
        simulate_blocking(wrong)


def test_blocking_reports_missing_receive():
    no_recv = Schedule(
        (
            tuple(map(Action.parse, "0F0 0B0".split())),
            tuple(map(Action.parse, "1F0 1B0".split())),
        ),
        1,
        (0, 1),
    )
    with pytest.raises(ScheduleError, match=r"rank 0, position 1: 0B0 runs before its input 0RECV_B0 is there"):
        simulate_blocking(no_recv)




# -- tie reductions (Note [tie reduction]) ---------------------------------------------------------


def test_a_tie_reduction_ends_each_rank_of_the_tie_and_the_simulator_charges_it():
    lowered = lower(get_schedule("1f1b", 4, 8), ties=[(0, 3)])
    ends = [acts[-1] for acts in lowered.ranks]
    assert ends[0] == Action(0, Kind.TIE_REDUCE, tie_group=0) and ends[3] == Action(3, Kind.TIE_REDUCE, tie_group=0)
    assert all(a.kind is not Kind.TIE_REDUCE for r in (1, 2) for a in lowered.ranks[r])
    assert simulate_blocking(lowered).transfers == 48
    assert Schedule.from_text(lowered.to_text()).ranks == lowered.ranks  # "0TIE_REDUCE0" parses back
    # Rank 0 ends at 33 with unit costs; the reduction starts when ranks 0 and 3 are both there.
    assert simulate(lowered).makespan == 33.0
    assert simulate(lowered, Costs(tie=2.0)).makespan == 35.0
    # A tie that lives on one rank (V shape: stages 0 and 3 on rank 0) is a local sum: not charged.
    v_shape = lower(get_schedule("zbv", 2, 4), ties=[(0, 3)])
    assert [a for a in v_shape.ranks[1] if a.kind is Kind.TIE_REDUCE] == []
    assert simulate(v_shape, Costs(tie=2.0)).makespan == simulate(v_shape).makespan


def test_overlapping_ties_cannot_deadlock_and_bad_ties_are_refused():
    lowered = lower(get_schedule("1f1b", 4, 4), ties=[(0, 3), (0, 2, 3)])
    assert [a.tie_group for a in lowered.ranks[0] if a.kind is Kind.TIE_REDUCE] == [0, 1]
    assert [a.tie_group for a in lowered.ranks[3] if a.kind is Kind.TIE_REDUCE] == [0, 1]
    simulate_blocking(lowered)
    simulate(lowered, Costs(tie=1.0))
    # Reductions in different orders on two ranks would wait for each other: both checks say so.
    crossed = lowered.replace(ranks=(lowered.ranks[0][:-2] + lowered.ranks[0][-2:][::-1],) + lowered.ranks[1:])
    with pytest.raises(DeadlockError, match=r"stuck at 0TIE_REDUCE1 \(waiting for its tie group\)"):
        simulate_blocking(crossed)
    with pytest.raises(ScheduleError, match=r"waits for the other ranks of tie group"):
        simulate(crossed)
    with pytest.raises(ValueError, match=r"tie group 0 \[1\] must name two or more distinct stages of 0..3"):
        lower(get_schedule("1f1b", 4, 4), ties=[(1,)])
