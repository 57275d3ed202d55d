"""Which process groups each actor forms, and in what order (Note [group formation] in
actors/group_plan.py): as data up to 4,096 actors, through the formations with
``torch.distributed`` patched (calls counted per actor), and in real gloo processes."""

from __future__ import annotations

import collections
import datetime
import multiprocessing
import types

import pytest
import torch

from actors.comm import Communicator, free_address
from actors.grid import DeviceGrid
from actors.group_plan import GroupKind, GroupPlan
from actors.groups import EveryRank, MembersOnly, SplitRounds, formation_for
from schedules import get_schedule, linked_ranks

GRIDS = [(1, 2, 1), (1, 3, 1), (2, 3, 1), (3, 5, 2), (2, 4, 2), (4, 7, 1), (8, 16, 8), (32, 16, 8), (1, 4096, 1),
         (1024, 4, 1), (1365, 3, 1)]


def _chain_or_ring(pp: int, ring: bool) -> list[tuple[int, int]]:
    """The linked pairs of one stage per rank (ring: the fed targets' link closes it, as 1F1B's
    does) or of a V (zbv: first and last stage on rank 0, a chain)."""
    if ring:
        return linked_ranks(types.SimpleNamespace(stage_to_rank=list(range(pp)), num_stages=pp))
    return [(r, r + 1) for r in range(pp - 1)]


def _plan(dp: int, pp: int, tp: int, ring: bool = True, tie_ends=None) -> tuple[GroupPlan, DeviceGrid]:
    grid = DeviceGrid(dp=dp, pp=pp, tp=tp)
    ends = tie_ends if tie_ends is not None else ((0, pp - 1) if pp > 1 else None)
    ties = [[grid.actor(d, r, t) for r in ends] for d in range(dp) for t in range(tp)] if ends else []
    return GroupPlan.of(dp=grid.dp_groups(), tp=grid.tp_groups(), pairs=grid.pair_groups(_chain_or_ring(pp, ring)),
                        ties=ties), grid


@pytest.mark.parametrize("dp,pp,tp", GRIDS)
@pytest.mark.parametrize("ring", [True, False])
def test_each_actor_forms_its_own_groups_once_with_agreeing_names(dp, pp, tp, ring):
    plan, grid = _plan(dp, pp, tp, ring)
    formed = collections.Counter()  # what torch counts in a group's name: the groups this process formed
    for g in plan.members_order:
        assert len({formed[r] for r in g.ranks}) == 1, f"the members of {g} disagree on its name"
        formed.update(g.ranks)
    for rank in range(grid.size):
        mine = plan.member_calls(rank)
        assert all(rank in g.ranks for g in mine)
        own = sorted(g for g in plan.groups if rank in g.ranks)
        assert sorted(g for g in mine if g.kind is not GroupKind.PAD) == own
        assert all(g.ranks == (rank,) for g in mine if g.kind is GroupKind.PAD)
        assert plan.calls(rank, "members") <= 8  # a handful whatever the size (dp, tp, 2-3 pairs, a tie, pads)
        assert plan.calls(rank, "every") == len(plan.groups)
    order = {g: i for i, g in enumerate(plan.members_order)}
    assert all(order[a] < order[b] for r in range(grid.size) for a, b in zip(plan.member_calls(r),
                                                                              plan.member_calls(r)[1:]))


@pytest.mark.parametrize("dp,pp,tp", GRIDS)
def test_nccl_splits_the_world_once_per_round_of_disjoint_groups(dp, pp, tp):
    plan, _ = _plan(dp, pp, tp)
    rounds = plan.split_rounds
    assert len(rounds) <= 6
    assert sorted(g for r in rounds for g in r) == sorted(plan.groups)
    for r in rounds:
        assert len({g.kind for g in r}) == 1
        members = [x for g in r for x in g.ranks]
        assert len(members) == len(set(members)), f"a round's groups overlap: {r}"


def test_the_world_sizes_of_the_issue():
    """Calls per actor: every group before, a handful after (Note [group formation])."""
    plan, grid = _plan(32, 16, 8)
    assert grid.size == 4096 and len(plan.groups) == 4992
    assert max(plan.calls(r, "members") for r in range(grid.size)) == 5
    assert plan.calls(0, "split") == 5


def test_an_odd_ring_pads_an_even_ring_does_not():
    even, _ = _plan(1, 4, 1, tie_ends=())
    odd, _ = _plan(1, 3, 1, tie_ends=())
    assert not [g for g in even.members_order if g.kind is GroupKind.PAD]
    assert [g for g in odd.members_order if g.kind is GroupKind.PAD]  # a triangle cannot agree otherwise
    assert repr(odd.groups[0]) == "pair0[0, 1]"


def test_indices_are_positions_in_the_given_lists():
    plan = GroupPlan.of(dp=[[0], [1]], ties=[[3, 1], [0, 2]], pairs=[[0, 1]])
    assert [(g.kind, g.index, g.ranks) for g in plan.groups] == [
        (GroupKind.PAIR, 0, (0, 1)), (GroupKind.TIE, 0, (1, 3)), (GroupKind.TIE, 1, (0, 2))]


def test_unknown_formations_are_refused():
    with pytest.raises(ValueError, match="unknown group formation 'all'; use one of members, split, every"):
        formation_for("gloo", "all")
    with pytest.raises(ValueError, match="group formation 'split' needs NCCL"):
        formation_for("gloo", "split")
    with pytest.raises(ValueError, match="unknown group formation 'x'"):
        GroupPlan.of().calls(0, "x")
    assert isinstance(formation_for("nccl"), SplitRounds) and isinstance(formation_for("gloo"), MembersOnly)


class _FakeDist:
    """``torch.distributed``'s group creation, recorded: what one actor calls."""

    def __init__(self, rank: int) -> None:
        self.rank, self.calls = rank, []

    def new_group(self, ranks, backend=None, timeout=None, use_local_synchronization=False):
        self.calls.append(("new_group", tuple(ranks), use_local_synchronization, timeout))
        return ("group", tuple(ranks)) if self.rank in ranks else object()

    def split_group(self, split_ranks, timeout=None):
        self.calls.append(("split_group", tuple(map(tuple, split_ranks)), timeout))
        return next((("group", tuple(g)) for g in split_ranks if self.rank in g), None)


@pytest.mark.parametrize("formation", [MembersOnly(), EveryRank(), SplitRounds()], ids=lambda f: f.name)
def test_each_formation_keeps_this_actors_groups(monkeypatch, formation):
    import actors.groups as groups_module

    plan, grid = _plan(2, 3, 2)
    pair_timeout = datetime.timedelta(seconds=7)
    for rank in range(grid.size):
        fake = _FakeDist(rank)
        monkeypatch.setattr(groups_module, "dist", fake)
        formed = formation.form(plan, rank, backend="gloo", timeouts={GroupKind.PAIR: pair_timeout})
        d, r, t = grid.coord(rank)
        assert formed.dp == ("group", tuple(grid.dp_group(r, t))) and formed.dp_size == 2
        assert formed.tp == ("group", tuple(grid.tp_group(d, r)))
        assert {peer: g[1] for peer, g in formed.pairs.items()} == {
            grid.actor(d, (r + k) % 3, t): tuple(sorted((rank, grid.actor(d, (r + k) % 3, t)))) for k in (1, 2)}
        tie = [g for g in plan.groups if g.kind is GroupKind.TIE and rank in g.ranks]
        assert formed.ties == {g.index: ("group", g.ranks) for g in tie}
        assert formed.calls == len(fake.calls) == plan.calls(rank, formation.name)
        specs = {"members": plan.member_calls(rank), "every": plan.groups,
                 "split": [r[0] for r in plan.split_rounds]}[formation.name]
        for call, spec in zip(fake.calls, specs):
            assert call[-1] == (pair_timeout if spec.kind is GroupKind.PAIR else None)
            if formation.name == "members":  # only its own groups (and pads), each synchronised among its members
                assert call[1] == spec.ranks and rank in spec.ranks and call[2]


def _form_and_use(rank: int, world: int, address, out) -> None:
    """dp=2 replicas of a 3-rank ring (odd: pads needed) with a tie, NCCL's pairs (queued)."""
    try:
        grid = DeviceGrid(dp=2, pp=3)
        links = linked_ranks(get_schedule("1f1b", 3, 3))
        ties = [[grid.actor(d, 0), grid.actor(d, 2)] for d in range(2)]
        comm = Communicator(world_size=world, rank=rank, address=address, backend="gloo", timeout_s=60.0,
                            dp_groups=grid.dp_groups(), tie_groups=ties, p2p_groups=grid.pair_groups(links),
                            device=torch.device("cpu"), queued=True)
        import torch.distributed as dist

        sums = {}
        named = [("dp", comm.dp_group)] + sorted(comm.groups.pairs.items()) + sorted(comm.tie_groups.items())
        for name, group in named:
            t = torch.ones(1)
            dist.all_reduce(t, group=group)
            sums[name] = int(t.item())
        out.put((rank, "ok", sums, comm.groups.calls))
        comm.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", repr(e), 0))


def test_gloo_actors_form_only_their_groups_and_every_group_works():
    ctx = multiprocessing.get_context("spawn")
    out, address, world = ctx.Queue(), free_address(), 6
    procs = [ctx.Process(target=_form_and_use, args=(r, world, address, out)) for r in range(world)]
    for p in procs:
        p.start()
    got = {}
    for _ in procs:
        rank, status, detail, calls = out.get(timeout=180)
        got[rank] = (status, detail, calls)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert all(status == "ok" for status, _, _ in got.values()), got
    grid = DeviceGrid(dp=2, pp=3)
    plan = GroupPlan.of(dp=grid.dp_groups(), pairs=grid.pair_groups(linked_ranks(get_schedule("1f1b", 3, 3))),
                        ties=[[grid.actor(d, 0), grid.actor(d, 2)] for d in range(2)])
    for rank, (_, sums, calls) in got.items():
        assert calls == plan.calls(rank, "members") < len(plan.groups)
        assert all(v == 2 for v in sums.values()), sums  # every group of two, each with its two members


@pytest.mark.parametrize("dp,ep", [(2, 2), (4, 2), (4, 4)])
def test_ep_and_edp_groups_form_in_agreeing_order(dp, ep):
    """Note [group formation]: the EP and EDP groups (Note [expert parallelism] in actors/grid.py)
    after dp and tp, every actor in one of each, names agreeing, NCCL rounds disjoint."""
    grid = DeviceGrid(dp=dp, pp=2, ep=ep)
    plan = GroupPlan.of(dp=grid.dp_groups(), ep=grid.ep_groups(), edp=grid.edp_groups(),
                        pairs=grid.pair_groups(_chain_or_ring(2, False)))
    kinds = [g.kind for g in plan.groups]
    assert kinds.index(GroupKind.EP) > kinds.index(GroupKind.DP)
    assert (GroupKind.EDP in kinds) == (dp > ep)
    formed = collections.Counter()
    for g in plan.members_order:
        assert len({formed[r] for r in g.ranks}) == 1, f"the members of {g} disagree on its name"
        formed.update(g.ranks)
    for r in plan.split_rounds:
        members = [x for g in r for x in g.ranks]
        assert len(members) == len(set(members))
