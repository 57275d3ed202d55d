"""The cp axis of the device grid (Note [device grid]): actors in (replica, pipeline rank, CP rank,
TP rank) order, CP groups, gradient groups over dp x cp, point-to-point pairs that keep the CP rank."""

from __future__ import annotations

from actors.grid import DeviceGrid
from actors.group_plan import GroupKind, GroupPlan


def test_actors_are_replica_then_rank_then_cp_then_tp():
    grid = DeviceGrid(dp=2, pp=2, tp=2, cp=2)
    assert grid.size == 16
    order = [(d, r, c, t) for d in range(2) for r in range(2) for c in range(2) for t in range(2)]
    assert [grid.actor(d, r, t, c) for d, r, c, t in order] == list(range(16))
    for i, (d, r, c, t) in enumerate(order):
        assert tuple(grid.coord(i)) == (d, r, t) and grid.cp_rank_of(i) == c


def test_groups_along_cp():
    grid = DeviceGrid(dp=2, pp=2, cp=2)
    assert grid.cp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.dp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]  # a rank's replicas and CP ranks average together
    assert grid.reducing == 4 and grid.reduce_index(1, 1) == 3 and grid.dp_group(0)[grid.reduce_index(1, 1)] == 5
    assert grid.pair_groups([(0, 1)]) == [[0, 2], [1, 3], [4, 6], [5, 7]]  # CP rank c talks to CP rank c
    assert grid.pipeline(1, cp=1) == [5, 7]
    plan = GroupPlan.of(dp=grid.dp_groups(), cp=grid.cp_groups())
    assert [s.ranks for s in plan.groups if s.kind is GroupKind.CP] == [(0, 1), (2, 3), (4, 5), (6, 7)]


def test_cp1_leaves_the_grid_as_it_was():
    old, new = DeviceGrid(dp=2, pp=3, tp=2), DeviceGrid(dp=2, pp=3, tp=2, cp=1)
    assert old == new and old.dp_groups() == [[old.actor(0, r, t), old.actor(1, r, t)] for r in range(3)
                                              for t in range(2)]
    assert old.cp_groups() == [[i] for i in range(12)]
