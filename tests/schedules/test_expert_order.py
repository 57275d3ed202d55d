"""The EP all-to-alls in the NCCL-order model (Note [expert all-to-alls in the order model] in
schedules/expert_order.py): one order on every member of an EP group, proven before launch."""

from __future__ import annotations

import pytest

from schedules import (PREFETCH, Action, DeadlockError, ExpertCollectives, Kind, check_exchange_order, get_schedule,
                       lower, schedule_names, simulate_blocking)
from schedules.expert_order import exchange_order
from schedules.posting import posts_of_rank
from schedules.nccl_order import step_peers


def _train(name, p, m, dp=2):
    return lower(get_schedule(name, p, m), allreduce=dp > 1, sink=True)


def _program(text: str, like):
    """A lowered two-rank program from its text, one line per rank."""
    return like.replace(ranks=tuple(tuple(map(Action.parse, line.split())) for line in text.strip().splitlines()))


def test_each_compute_action_of_a_moe_stage_posts_its_exchanges_on_its_ep_group():
    ex = ExpertCollectives.of_blocks(2, {1: 2}, loads=True, aux=True)
    assert ex.exchanges(1, Kind.F) == 6 and ex.exchanges(1, Kind.B) == 4 and ex.exchanges(1, Kind.W) == 0
    assert ex.exchanges(0, Kind.F) == 0  # a stage without MoE blocks exchanges nothing
    assert ExpertCollectives.of_blocks(2, {1: 2}, split_fallback=True).exchanges(1, Kind.W) == 4
    assert ExpertCollectives.of_blocks(2, {1: 2}, recomputed={1}).exchanges(1, Kind.I) == 10  # the forward again
    assert ExpertCollectives.of_blocks(1, {1: 2}).exchanges(1, Kind.F) == 0  # ep=1: the experts stay local
    first = ExpertCollectives.of_blocks(2, {0: 1})  # no input gradient: W runs the whole backward
    assert (first.exchanges(0, Kind.I), first.exchanges(0, Kind.W), first.exchanges(0, Kind.B)) == (0, 2, 2)
    low = _train("1f1b", 2, 2, dp=4)
    prog = low.ranks[1]
    posts = posts_of_rank(prog, step_peers(low, prog), replica=3, num_ranks=2, rank=1, window=PREFETCH, ordered=True,
                          relearn=False, fed=None, train=True, experts=ex, dp=4)
    colls = [(repr(x.action), x.group, x.message) for x in posts if x.op == "coll"]
    # replica 3 is EP rank 1 of EP group 1 (replicas 2, 3) and in EDP group 1 (replicas 1, 3)
    assert colls[:7] == [("1F0", ("ep", 1, 1), ("all-to-all", j)) for j in range(6)] + [
        ("1B0", ("ep", 1, 1), ("all-to-all", 0))]
    assert colls[-5:] == [("1ALLREDUCE", ("dp", 1), ()), ("1ALLREDUCE", ("edp", 1, 1), ("experts",)),
                          ("None", ("world",), ()), ("None", ("dp", 1), ("loads", 1)), ("None", ("dp", 1), ("aux",))]
    assert exchange_order(prog, ex)[:7] == [(Action(1, Kind.F, 0), j) for j in range(6)] + [(Action(1, Kind.B, 0), 0)]
    with pytest.raises(ValueError, match=r"per_action\[1\]: expected \{F, B, I, W: count >= 0\}"):
        ExpertCollectives(ep=2, per_action={1: {Kind.SEND_F: 1}})
    with pytest.raises(ValueError, match=r"experts.ep=4 must divide dp=2"):
        simulate_blocking(low, semantics="nccl", dp=2, experts=ExpertCollectives.of_blocks(4, {1: 1}))


@pytest.mark.parametrize("name", schedule_names())
def test_every_builtin_schedule_passes_at_pp2_dp2_ep2(name):
    """pp=2 x dp=2 x ep=2, every stage a MoE stage: the first step (headers) and later ones (prefetch),
    fed or not, the split backward exact or falling back, recomputed or not; dp=4 (EDP groups of 2)."""
    checked = 0
    for m in (1, 2, 3, 4, 8):
        try:
            s = get_schedule(name, 2, m)
        except ValueError:
            continue
        blocks = {stage: 1 + stage % 2 for stage in range(s.num_stages)}
        for dp in (2, 4):
            low = _train(name, 2, m, dp)
            for fallback in (False, True):
                for recomputed in ((), tuple(blocks)):
                    ex = ExpertCollectives.of_blocks(2, blocks, split_fallback=fallback, recomputed=recomputed,
                                                     loads=True, aux=True)
                    check_exchange_order([low.ranks] * dp, ex)
                    for relearn, fed in ((False, False), (False, True), (True, True)):
                        simulate_blocking(low, semantics="nccl", prefetch=PREFETCH, dp=dp, relearn=relearn, fed=fed,
                                          experts=ex)
                    simulate_blocking(low, semantics="nccl", prefetch=PREFETCH, dp=dp, experts=ex,
                                      communicators="world")
                    checked += 1
    assert checked >= 8


def test_members_issuing_their_exchanges_in_different_orders_are_refused_by_name():
    """Replica 0 runs 1F1B, replica 1 GPipe: alone each runs, but rank 1's EP group would meet
    1B0's exchange on one member and 1F1's on the other."""
    one_f_one_b, gpipe = _train("1f1b", 2, 4), _train("gpipe", 2, 4)
    ex = ExpertCollectives.of_blocks(2, {0: 1, 1: 1})
    for low in (one_f_one_b, gpipe):
        simulate_blocking(low, semantics="nccl", dp=2, experts=ex)
    with pytest.raises(DeadlockError, match=r"(?s)the EP group of pipeline rank 1 \(replicas 0, 1\) would hang: its "
                                            r"members reach different collectives first.*replica 0, rank 1: at 1B0's "
                                            r"all-to-all 1 on its EP group.*replica 1, rank 1: at 1F1's all-to-all 1"):
        simulate_blocking(one_f_one_b, semantics="nccl", dp=2, experts=ex, replicas=[one_f_one_b, gpipe])
    with pytest.raises(ValueError, match=r"the EP group of pipeline rank 0 would hang: replica 0 issues 0B0's "
                                         r"all-to-all 1 as its all-to-all number 7 while replica 1 issues 0F2's"):
        check_exchange_order([one_f_one_b.ranks, gpipe.ranks], ex)
    # Without experts the two replicas never meet: the point-to-point order alone runs.
    simulate_blocking(one_f_one_b, semantics="nccl", dp=2, replicas=[one_f_one_b, gpipe])


def test_one_order_of_exchanges_that_closes_a_cycle_with_the_messages_is_refused():
    """Both replicas issue rank 0's exchanges as 0F0 0F1 0B0 0B1 and rank 1's as 1F0 1B0 1F1 1B1,
    and each runs alone; together replica 0's rank 0 waits for 0B0's gradient before 0F1's
    exchange, which replica 1's rank 0 reaches before it sends F0, which replica 1's rank 1 needs
    before 1F0's exchange, which replica 0's rank 1 needs before it sends that gradient."""
    like = _train("1f1b", 2, 2, dp=1)
    a = _program("""
        0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0B0 0RECV_B1 0B1
        1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1""", like)
    b = _program("""
        0F0 0F1 0SEND_F0 0RECV_B0 0SEND_F1 0B0 0RECV_B1 0B1
        1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1""", like)
    ex = ExpertCollectives.of_blocks(2, {0: 1, 1: 1})
    check_exchange_order([a.ranks, b.ranks], ex)  # one order on every member...
    for low in (a, b):
        simulate_blocking(low, semantics="nccl", dp=2, experts=ex, train=False)
        simulate_blocking(low, semantics="nccl", prefetch=0, dp=2, experts=ex, train=False)
    with pytest.raises(DeadlockError, match=r"(?s)deadlock under NCCL's order.*rank 0 \(replica 1\): stuck at 0F1's "
                                            r"all-to-all 1 on its EP group.*rank 1 \(replica 1\): stuck at 1RECV_F0"):
        simulate_blocking(a, semantics="nccl", prefetch=0, dp=2, experts=ex, replicas=[a, b], train=False)  # ...hangs
