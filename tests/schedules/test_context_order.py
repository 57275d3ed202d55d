"""The ring steps of context parallelism in the NCCL-order model (Note [ring exchanges in the
order model] in schedules/context_order.py): one order on every member of a CP group, proven
before launch, and a program whose CP members disagree refused by name."""

from __future__ import annotations

import pytest

from schedules import (PREFETCH, Action, DeadlockError, ExpertCollectives, Kind, RingExchanges, check_ring_order,
                       get_schedule, lower, schedule_names, simulate_blocking)
from schedules.context_order import ring_order
from schedules.nccl_order import step_peers
from schedules.posting import posts_of_rank


def _train(name, p, m, members=2):
    return lower(get_schedule(name, p, m), allreduce=members > 1, sink=True)


def _program(text: str, like):
    return like.replace(ranks=tuple(tuple(map(Action.parse, line.split())) for line in text.strip().splitlines()))


def test_each_attention_action_posts_its_ring_steps_on_its_cp_group():
    ring = RingExchanges.of_attention(2, {0: 2, 1: 2})
    # per call: cp-1 = 1 step forward, 2cp-1 = 3 backward; two attention calls per stage
    assert [ring.exchanges(1, k) for k in (Kind.F, Kind.B, Kind.I, Kind.W)] == [2, 6, 6, 0]
    assert [ring.exchanges(0, k) for k in (Kind.I, Kind.W)] == [0, 6]  # no input gradient: W runs the backward
    assert RingExchanges.of_attention(2, {1: 2}, split_fallback=True).exchanges(1, Kind.W) == 6
    assert RingExchanges.of_attention(2, {1: 2}, recomputed={1}).exchanges(1, Kind.I) == 8  # the forward again
    assert RingExchanges.of_attention(4, {1: 1}).exchanges(1, Kind.B) == 7
    assert RingExchanges.of_attention(1, {1: 2}).per_action == {}  # cp=1: no ring
    assert RingExchanges.of_attention(2, {0: 0, 1: 1}).exchanges(0, Kind.F) == 0  # a stage without attention
    with pytest.raises(ValueError, match=r"per_action\[1\]: expected \{F, B, I, W: count >= 0\}"):
        RingExchanges(cp=2, per_action={1: {Kind.SEND_F: 1}})
    # dp=2 x cp=2 x ep=2: the model's members are replica x cp + CP rank; member 3 is replica 1, CP rank 1
    low = _train("1f1b", 2, 2, members=4)
    prog = low.ranks[1]
    ex = ExpertCollectives.of_blocks(2, {1: 1})
    posts = posts_of_rank(prog, step_peers(low, prog), replica=3, num_ranks=2, rank=1, window=PREFETCH, ordered=True,
                          relearn=False, fed=None, train=True, experts=ex, dp=4, ring=RingExchanges.of_attention(2, {1: 1}))
    colls = [(repr(x.action), x.group, x.message) for x in posts if x.op == "coll"]
    # the ring's step on CP group (rank 1, replica 1), then the all-to-alls on EP group 1: members 2..3
    # (Note [expert parallelism] in actors/grid.py)
    assert colls[:4] == [("1F0", ("cp", 1, 1), ("ring", 0))] + [
        ("1F0", ("ep", 1, 1), ("all-to-all", j)) for j in range(3)]
    assert ring_order(prog, RingExchanges.of_attention(2, {1: 1}))[:4] == [
        (Action(1, Kind.F, 0), 0), (Action(1, Kind.B, 0), 0), (Action(1, Kind.B, 0), 1), (Action(1, Kind.B, 0), 2)]
    with pytest.raises(ValueError, match=r"ring.cp=2 must divide dp=3"):
        simulate_blocking(low, semantics="nccl", dp=3, ring=RingExchanges.of_attention(2, {1: 1}))


def test_the_auxiliary_loss_sums_count_where_a_graph_is_built():
    """Note [auxiliary loss under CP]: one CP sum per MoE layer in each forward that builds a graph."""
    ring = RingExchanges.of_attention(2, {1: 1}, reductions={1: 2})
    assert [ring.exchanges(1, k) for k in (Kind.F, Kind.B, Kind.I, Kind.W)] == [3, 3, 3, 0]  # 1 step + 2 sums in F
    again = RingExchanges.of_attention(2, {1: 1, 2: 0}, reductions={1: 2, 2: 1}, recomputed={1, 2})
    assert again.exchanges(1, Kind.F) == 3 and again.exchanges(1, Kind.B) == 6  # B replays the forward: sums too
    assert again.exchanges(1, Kind.F, split=True) == 1 and again.exchanges(1, Kind.I) == 6  # graph-free F; I replays
    assert again.exchanges(2, Kind.F) == 1 and again.exchanges(2, Kind.F, split=True) == 0  # experts, no attention
    low = _train("zb-h1", 2, 4)
    steps = {(a.stage, a.microbatch): n for a, n in ((a, again.action_steps(a, set())) for a in low.ranks[1])
             if a.kind is Kind.F}
    assert steps == {(1, m): 3 for m in range(4)}
    split = {(1, m) for m in range(4)}
    assert all(again.action_steps(a, split) == 1 for a in low.ranks[1] if a.kind is Kind.F)
    first_f = next(a for a in low.ranks[1] if a.kind is Kind.F)  # zb-h1 splits: its F posts the ring step alone
    assert [j for a, j in ring_order(low.ranks[1], again) if a == first_f] == [0]


@pytest.mark.parametrize("name", schedule_names())
def test_every_builtin_schedule_passes_at_pp2_cp2(name):
    """pp=2 x cp=2 x ep=2 (at dp=1 the EP group is the CP group; at dp=2 a replica's two CP ranks,
    Note [expert parallelism] in actors/grid.py), every stage with attention and experts: the first
    step and later ones, fed or not, the split backward exact or falling back, recomputed or not."""
    checked = 0
    for m in (2, 4):
        try:
            s = get_schedule(name, 2, m)
        except ValueError:
            continue
        calls = {stage: 1 + stage % 2 for stage in range(s.num_stages)}
        for members in (2, 4):
            low = _train(name, 2, m, members)
            ex = ExpertCollectives.of_blocks(2, calls, loads=True)
            for fallback in (False, True):
                for recomputed in ((), tuple(calls)):
                    ring = RingExchanges.of_attention(2, calls, split_fallback=fallback, recomputed=recomputed)
                    check_ring_order([low.ranks] * members, ring)
                    for relearn, fed in ((False, False), (True, True)):
                        simulate_blocking(low, semantics="nccl", prefetch=PREFETCH, dp=members, relearn=relearn,
                                          fed=fed, ring=ring, experts=ex)
                    checked += 1
    assert checked >= 8


def test_cp_members_posting_their_ring_steps_in_different_orders_are_refused_by_name():
    """CP rank 0 runs 1F1B, CP rank 1 GPipe: alone each runs, but rank 1's CP group would meet
    1B0's ring step on one member and 1F1's on the other."""
    one_f_one_b, gpipe = _train("1f1b", 2, 4), _train("gpipe", 2, 4)
    ring = RingExchanges.of_attention(2, {0: 1, 1: 1})
    for low in (one_f_one_b, gpipe):
        simulate_blocking(low, semantics="nccl", dp=2, ring=ring)
    simulate_blocking(one_f_one_b, semantics="nccl", dp=2, replicas=[one_f_one_b, gpipe])  # without the ring: runs
    with pytest.raises(DeadlockError, match=r"(?s)the CP group of pipeline rank 1 \(replica 0, CP ranks 0..1\) would "
                                            r"hang: its members reach different collectives first.*replica 0, CP rank 0,"
                                            r" rank 1: at 1B0's ring step 1 on its CP group.*replica 0, CP rank 1, "
                                            r"rank 1: at 1F1's ring step 1"):
        simulate_blocking(one_f_one_b, semantics="nccl", dp=2, ring=ring, replicas=[one_f_one_b, gpipe])
    with pytest.raises(ValueError, match=r"the CP group of pipeline rank 0 \(replica 0\) would hang: CP rank 0 posts "
                                         r"0B0's ring step 1 as its ring step number 3 while CP rank 1 posts 0F2's"):
        check_ring_order([one_f_one_b.ranks, gpipe.ranks], ring)


def test_one_order_of_ring_steps_that_closes_a_cycle_with_the_messages_is_refused():
    """Both CP ranks post rank 0's ring steps as 0F0 0F1 0B0 0B1 and each runs alone; together CP
    rank 0's rank 0 waits for 0B0's gradient before 0F1's ring step, which CP rank 1's rank 0
    reaches before it sends F0, which CP rank 1's rank 1 needs before 1F0's step, which CP rank
    0's rank 1 needs before it sends that gradient."""
    like = _train("1f1b", 2, 2, members=1)
    a = _program("""
        0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0B1
        1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1""", like)
    b = _program("""
        0F0 0F1 0SEND_F0 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1
        1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1""", like)
    ring = RingExchanges.of_attention(2, {0: 1, 1: 1})
    check_ring_order([a.ranks, b.ranks], ring)  # one order on every member...
    for low in (a, b):
        simulate_blocking(low, semantics="nccl", prefetch=0, dp=2, ring=ring, train=False)
    with pytest.raises(DeadlockError, match=r"(?s)deadlock under NCCL's order.*rank 0 \(replica 1\): stuck at 0F1's "
                                            r"ring step 1 on its CP group.*rank 1 \(replica 1\): stuck at 1RECV_F0"):
        simulate_blocking(a, semantics="nccl", prefetch=0, dp=2, ring=ring, replicas=[a, b], train=False)  # ...hangs
