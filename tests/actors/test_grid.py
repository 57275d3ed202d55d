"""The device grid (Note [device grid] in actors/grid.py): which actor is which, and the groups."""

from __future__ import annotations

import pytest

from actors.grid import DeviceGrid, GridCoord


def test_actors_are_replica_major_then_rank_then_tp():
    grid = DeviceGrid(dp=2, pp=3, tp=2)
    assert grid.size == 12
    assert [grid.coord(a) for a in range(4)] == [GridCoord(0, 0, 0), GridCoord(0, 0, 1), GridCoord(0, 1, 0),
                                                 GridCoord(0, 1, 1)]
    assert all(grid.actor(*grid.coord(a)) == a for a in range(grid.size))
    assert grid.pipeline(1, tp=1) == [7, 9, 11]
    assert grid.tp_group(1, 2) == [10, 11]


def test_dp_groups_join_one_rank_across_replicas():
    grid = DeviceGrid(dp=3, pp=2)
    assert grid.dp_groups() == [[0, 2, 4], [1, 3, 5]]
    assert grid.dp_group(1) == [1, 3, 5] and grid.rank_of(3) == 1 and grid.replica_of(3) == 1


def test_outside_the_grid_is_refused():
    with pytest.raises(ValueError, match="DeviceGrid.dp must be a positive integer"):
        DeviceGrid(dp=0, pp=2)
    with pytest.raises(IndexError, match="actor 4 is outside the grid of 4 actors"):
        DeviceGrid(dp=2, pp=2).coord(4)


def test_ep_groups_are_consecutive_replicas_and_edp_groups_hold_the_same_experts():
    """Note [expert parallelism]: replica d is EP rank d % ep of EP group d // ep."""
    grid = DeviceGrid(dp=4, pp=2, ep=2)
    assert [grid.ep_rank(d) for d in range(4)] == [0, 1, 0, 1]
    assert grid.ep_group(3, 1) == [grid.actor(2, 1), grid.actor(3, 1)] == [5, 7]
    assert grid.edp_group(3, 1) == [grid.actor(1, 1), grid.actor(3, 1)] == [3, 7]
    assert grid.ep_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert grid.edp_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    for groups in (grid.ep_groups(), grid.edp_groups()):  # each actor in exactly one of each
        assert sorted(a for g in groups for a in g) == list(range(grid.size))
    assert DeviceGrid(dp=2, pp=1).ep_groups() == [[0], [1]]  # ep=1: groups of one, never formed
    with pytest.raises(ValueError, match=r"DeviceGrid.ep=2 must divide dp=3"):
        DeviceGrid(dp=3, pp=1, ep=2)
