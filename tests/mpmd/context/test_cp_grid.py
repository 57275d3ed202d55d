"""The cp axis of the device grid (Note [device grid]): actors in (replica, pipeline rank, CP rank,
TP rank) order, CP groups, gradient groups over dp x cp, point-to-point pairs that keep the CP rank."""

from __future__ import annotations

import pytest

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


def test_the_order_check_counts_each_stages_attention_calls_and_names_the_ring():
    """Before launch (no actor): a GPT stage's Blocks and a Hugging Face stage's attention modules
    each make a ring per call (Note [ring exchanges in the order model]); a program that could hang
    on NCCL says it was checked with the ring steps."""
    import pytest

    from mpmd.models.gpt import GPTConfig, gpt_stages
    from mpmd.runtime.compile import compile_programs, pipeline_programs
    from mpmd.runtime.config import PipelineConfig, recipe_of
    from mpmd.runtime.cp import attention_calls
    from mpmd.runtime.transport import check_before_launch, check_nccl_order, pipeline_rings
    from schedules import DeadlockError, Kind, get_schedule
    from tests.mpmd.runtime.test_nccl_order_transport import CROSSED

    stages = gpt_stages(GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=3), 2)
    assert [attention_calls(m) for m in stages] == [2, 1]
    exact, fallback = pipeline_rings(stages, 2, recipe_of(PipelineConfig.from_options(cp=2), 2))
    assert [exact.exchanges(1, k) for k in (Kind.F, Kind.B, Kind.I, Kind.W)] == [1, 3, 3, 0]
    assert (exact.exchanges(0, Kind.W), fallback.exchanges(1, Kind.W)) == (6, 3)
    assert pipeline_rings(stages, 1, recipe_of(PipelineConfig.from_options(), 2)) == []  # cp=1: no ring
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=3,
                                   num_attention_heads=2, num_key_value_heads=1)
    import mpmd

    llama = mpmd.split(transformers.LlamaForCausalLM(cfg), num_stages=2, verbose=False)
    assert sum(attention_calls(m) for m in llama) == 3
    for name in ("1f1b", "zb-h1"):
        sched = get_schedule(name, 2, 4)
        members = 4  # dp=2 x cp=2
        check_before_launch("nccl", "cuda", 1.0, pipeline_programs(sched, members), sched, members, rings=[exact, fallback])
    with pytest.raises(DeadlockError, match=r"could hang on NCCL with the CP ring steps \(cp=2; the split backward "
                                            r"exact: W runs no ring\)"):
        check_nccl_order("train", compile_programs(CROSSED), CROSSED, 2, rings=[exact, fallback])


def test_ep_groups_draw_from_the_dp_x_cp_members_of_a_stage():
    """Note [expert parallelism]: member m = replica x cp + CP rank is EP rank m % ep of EP group
    m // ep; an EDP group is the members with the same EP rank; each EP group takes adjacent bundles."""
    from mpmd.runtime.cluster import bundle_of

    one = DeviceGrid(dp=1, pp=2, cp=2, ep=2)  # actors (replica 0): rank 0 CP 0, 1; rank 1 CP 0, 1
    assert [one.ep_rank(0, c) for c in range(2)] == [0, 1]
    assert one.ep_groups() == one.cp_groups() == [[0, 1], [2, 3]]  # the CP ranks split the experts
    assert one.edp_groups() == [[0], [1], [2], [3]] and one.ep_member(1, 1) == 3
    grid = DeviceGrid(dp=2, pp=2, cp=2, ep=2)  # members of rank 0: actors 0, 1 (replica 0), 4, 5 (replica 1)
    assert grid.ep_groups() == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert grid.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]] and grid.edp_group(1, 0, cp=1) == [1, 5]
    assert grid.ep_group(1, 1, cp=0) == [6, 7] and grid.ep_rank(1, 1) == 1
    wide = DeviceGrid(dp=2, pp=1, cp=2, ep=4)  # ep above dp: every member of the stage
    assert wide.ep_groups() == [[0, 1, 2, 3]] and wide.edp_groups() == [[0], [1], [2], [3]]
    assert DeviceGrid(dp=3, pp=1, cp=2, ep=2).ep_groups() == [[0, 1], [2, 3], [4, 5]]
    for g in (one, grid, wide):
        bundles = [bundle_of(g, i) for i in range(g.size)]
        assert sorted(bundles) == list(range(g.size))
        assert all(sorted(bundles[a] for a in m) == list(range(min(bundles[a] for a in m), min(bundles[a] for a in m)
                                                                 + g.ep)) for m in g.ep_groups())
    with pytest.raises(ValueError, match=r"DeviceGrid.ep=4 must divide dp=1 x cp=2"):
        DeviceGrid(dp=1, pp=1, cp=2, ep=4)
