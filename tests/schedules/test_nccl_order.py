"""NCCL's point-to-point order in the deadlock check (Note [NCCL order] in schedules/posting.py)."""

from __future__ import annotations

import pytest

from schedules import (PREFETCH, Action, DeadlockError, Kind, ScheduleError, add_fill_slots, get_schedule, linked_ranks,
                       lower, prefetch_ready, schedule_names, simulate_blocking)
from schedules.posting import posts_of_rank
from schedules.nccl_order import step_peers


def _train(name, p, m, dp=1, ties=()):
    """The training program as the engine lowers it (mpmd/runtime/compile.py ``lower_for_training``)."""
    return lower(get_schedule(name, p, m), allreduce=dp > 1, ties=ties, sink=True)


def test_todays_unordered_prefetch_deadlocks_1f1b_on_nccl_from_the_second_step():
    low = _train("1f1b", 2, 4)
    simulate_blocking(low)  # rendezvous: fine
    simulate_blocking(low, semantics="nccl", ordered=False, relearn=True)  # step 1 posts nothing ahead
    with pytest.raises(DeadlockError, match=r"(?s)from step 2 on \(prefetch 2, unordered\).*rank 0: stuck at 0RECV_B0 "
                                            r"\(waiting for data\); its streams start with 0RECV_B0 \(posted receive\)"
                                            r".*rank 1: stuck at 1RECV_F0"):
        simulate_blocking(low, semantics="nccl", prefetch=2, ordered=False)
    # What rank 0 posts: both receives ahead of its first send, on the one stream it shares with rank 1.
    posts = posts_of_rank(low.ranks[0], step_peers(low, low.ranks[0]), replica=0, num_ranks=2, rank=0, window=2,
                          ordered=False, relearn=False, fed=None, train=True)
    assert [(x.op, repr(x.action)) for x in posts[:4]] == [
        ("recv", "0RECV_B0"), ("recv", "0RECV_B1"), ("compute", "0F0"), ("send", "0SEND_F0")]
    # The order the actors use on NCCL passes, and a prefetch of 0 (nothing ahead) passes as well.
    assert simulate_blocking(low, semantics="nccl", prefetch=2).transfers == 8
    simulate_blocking(low, semantics="nccl", prefetch=0, ordered=False)


def test_ordered_prefetch_posts_a_receive_only_after_the_earlier_sends_to_its_peer():
    # rank 0 of 1F1B p=2 m=4: F0 SEND_F0 F1 SEND_F1 RECV_B0 B0 FREE0 F2 SEND_F2 RECV_B1 ...
    prog = _train("1f1b", 2, 4).ranks[0]
    kinds, peers = [a.kind for a in prog], [1 if a.kind.value[:4] in ("SEND", "RECV") else -1 for a in prog]
    at = [i for i, k in enumerate(kinds) if k in (Kind.RECV_F, Kind.RECV_B)]
    assert prefetch_ready(kinds, peers, at, 0, 0, {}, 2, ordered=False) == at[:2]
    assert prefetch_ready(kinds, peers, at, 0, 0, {}, 2, ordered=True) == []
    after_send_f1 = prog.index(Action(0, Kind.SEND_F, 1)) + 1
    assert prefetch_ready(kinds, peers, at, 0, after_send_f1, {}, 2, ordered=True) == [at[0]]  # SEND_F2 first
    assert prefetch_ready(kinds, peers, at, 0, after_send_f1, {at[0]: None}, 2, ordered=True) == []
    # Another peer's sends do not hold a receive back.
    other = [2 if k in (Kind.SEND_F, Kind.SEND_B) else p for k, p in zip(kinds, peers)]
    assert prefetch_ready(kinds, other, at, 0, 0, {}, 2, ordered=True) == at[:2]
    assert PREFETCH == 2


@pytest.mark.parametrize("name", schedule_names())
def test_every_program_the_runtime_installs_passes_both_semantics(name):
    """Every schedule x p 1-8 x m 1-16 x dp 1-2 with a tie: rendezvous, and NCCL's order in the
    first step (headers, nothing ahead) and later ones (prefetch), fed (targets first) or not; the
    forward program too.  (The fed targets only add a first message on both sides of one pair.)"""
    checked = 0
    for p in range(1, 9):
        for m in range(1, 17):
            try:
                s = get_schedule(name, p, m)
            except ValueError:
                continue  # a (p, m) this schedule does not take
            ties = [(0, s.num_stages - 1)] if s.num_stages > 1 else []
            for dp in (1, 2):
                low = _train(name, p, m, dp, ties)
                simulate_blocking(low)
                for relearn, fed in ((False, False), (False, True), (True, True)):
                    simulate_blocking(low, semantics="nccl", prefetch=PREFETCH, dp=dp, relearn=relearn, fed=fed)
                checked += 1
            fwd = lower(s.replace(ranks=tuple(tuple(a for a in r if a.kind is Kind.F) for r in s.ranks),
                                  forward_only=True))
            simulate_blocking(fwd, semantics="nccl", relearn=False)
            simulate_blocking(fwd, semantics="nccl", relearn=True)
    assert checked >= 40


def test_one_stream_per_rank_as_on_an_eagerly_initialised_world_group_hangs_interleaved_1f1b():
    """torch runs unbatched sends and receives of an eagerly initialised group on its one stream
    (Note [point-to-point groups] in actors/comm.py): modelled so, interleaved 1F1B hangs from its
    second step at 3 ranks and more, where a group per linked pair runs it."""
    for p, m in ((3, 3), (3, 6), (4, 8), (8, 8)):
        low = _train("interleaved-1f1b", p, m)
        simulate_blocking(low, semantics="nccl", relearn=True, communicators="world")  # nothing posted ahead yet
        with pytest.raises(DeadlockError, match=r"from step 2 on .*the world group's one stream"):
            simulate_blocking(low, semantics="nccl", communicators="world")
        simulate_blocking(low, semantics="nccl", communicators="pair")
    simulate_blocking(_train("interleaved-1f1b", 2, 4), semantics="nccl", communicators="world")  # two ranks: one pair
    for name in ("1f1b", "zbv", "dualpipev"):
        simulate_blocking(_train(name, 4, 8), semantics="nccl", communicators="world")
    # The pairs that get a group: consecutive stages' ranks, and the fed targets' ends.
    assert linked_ranks(_train("interleaved-1f1b", 4, 8)) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert linked_ranks(_train("1f1b", 4, 8)) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    assert linked_ranks(_train("zbv", 4, 8)) == [(0, 1), (1, 2), (2, 3)]
    assert linked_ranks(_train("1f1b", 1, 2)) == []
    with pytest.raises(ValueError, match=r"communicators='rank': expected one of 'pair', 'world'"):
        simulate_blocking(_train("1f1b", 2, 2), semantics="nccl", communicators="rank")


def test_fill_slots_and_every_window_keep_the_order():
    low = _train("zb-h1", 4, 8, dp=2, ties=[(0, 3)])
    at = {r: [i for i, a in enumerate(acts) if a.kind in (Kind.RECV_F, Kind.RECV_B)] for r, acts in enumerate(low.ranks)}
    filled = add_fill_slots(low, at)
    for window in (0, 1, 2, 3, 8):
        simulate_blocking(filled, semantics="nccl", prefetch=window, dp=2, fed=True)
    with pytest.raises(DeadlockError):
        simulate_blocking(filled, semantics="nccl", prefetch=2, dp=2, ordered=False)


def test_collectives_hold_their_group_and_messages_must_pair():
    low = _train("1f1b", 4, 4, ties=[(0, 3), (0, 2, 3)])
    simulate_blocking(low, semantics="nccl")
    crossed = low.replace(ranks=(low.ranks[0][:-2] + low.ranks[0][-2:][::-1],) + low.ranks[1:])
    with pytest.raises(DeadlockError, match=r"rank 0: stuck at 0TIE_REDUCE1"):
        simulate_blocking(crossed, semantics="nccl")
    # Two sends swapped on rank 0: the first message rank 1 gets is not the one it expects.
    r0 = list(low.ranks[0])
    i, j = r0.index(Action(0, Kind.SEND_F, 0)), r0.index(Action(0, Kind.SEND_F, 1))
    r0[i], r0[j] = r0[j], r0[i]
    swapped = low.replace(ranks=(tuple(r0),) + low.ranks[1:])
    with pytest.raises(ScheduleError, match=r"pair wrongly"):
        simulate_blocking(swapped, semantics="nccl", prefetch=0)


def test_bad_arguments_are_refused():
    low = _train("gpipe", 2, 2)
    with pytest.raises(ValueError, match=r"semantics='mpi': expected one of 'rendezvous', 'nccl'"):
        simulate_blocking(low, semantics="mpi")
    with pytest.raises(ValueError, match=r"prefetch \(-1\) must be >= 0"):
        simulate_blocking(low, semantics="nccl", prefetch=-1)
