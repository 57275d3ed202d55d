"""schedule="auto" weighs the expert all-to-alls and the overlap (docs/overlap.md): the
stages' a2a costs (``StageCost.a2a_f`` / ``a2a_b``, Note [all-to-all estimate] in
mpmd/planning/a2a.py), dualpipev simulated with and without OVERLAPs at ep > 1, the choice by
predicted step time and what the overlap buys in the table."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import schedules
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss
from mpmd.planning import StageCost, choose_schedule, plan_pipeline
from mpmd.planning.a2a import exchange_seconds, measured_exchanges
from mpmd.runtime import PipelineConfig

A2A = [StageCost(f=1.0, b=1.0, w=1.0, a2a_f=0.5, a2a_b=0.5, act_bytes=100, param_bytes=10) for _ in range(4)]


def _choose(costs, **kw):
    return choose_schedule(costs, memory_limit_bytes=1e9, microbatches=[8], schedule_names=["dualpipev", "zbv"],
                           num_ranks=2, **kw)


def test_stage_a2a_scales_with_rows_and_a_recomputed_backward_exchanges_again():
    c = StageCost(f=2.0, b=2.0, w=1.0, rows=4, a2a_f=0.5, a2a_b=0.3, a2a_f0=0.1, a2a_b0=0.1)
    half = c.at(2)
    assert (half.a2a_f, half.a2a_b) == pytest.approx((0.3, 0.2))  # fixed part + half the rest
    r = c.recomputed()
    assert (r.a2a_f, r.a2a_b, r.a2a_b0) == pytest.approx((0.5, 0.8, 0.2))
    with pytest.raises(ValueError, match=r"StageCost.a2a_b must be finite and >= 0"):
        StageCost(f=1.0, b=1.0, w=1.0, a2a_b=-1.0)


def test_the_estimate_is_dispatch_and_combine_of_top_k_rows_over_the_link():
    # 2 MoE layers (top 2), 1000 bytes of hidden state, ep=4: each exchange moves 2000 * 3/4 off the rank
    f, b, f0, b0 = exchange_seconds(1000.0, [2, 2], ep=4, latency_s=0.01, bytes_per_s=1000.0)
    wire = 2 * 2 * 2000 * 0.75 / 1000.0
    assert (f, b, f0, b0) == pytest.approx((wire + 6 * 0.01, wire + 4 * 0.01, 0.06, 0.04))
    assert exchange_seconds(1000.0, [2], ep=1, latency_s=0.01, bytes_per_s=1.0) == (0, 0, 0, 0)


def test_auto_at_ep_2_simulates_dualpipev_with_and_without_overlap_and_picks_the_faster():
    d = _choose(A2A, ep=2)
    by = {(o.schedule, o.overlap): o for o in d.options}
    assert set(by) == {("dualpipev", True), ("dualpipev", False), ("zbv", False)}
    plain = schedules.fuse_backwards(schedules.get_schedule("dualpipev", 2, 8))
    paired = schedules.fuse_backwards(schedules.get_schedule("dualpipev", 2, 8, overlap=True))
    costs = schedules.Costs(f=1.0, b=1.0, w=1.0, fused=2.0, a2a_f=0.5, a2a_b=0.5)
    assert by[("dualpipev", False)].step_s == schedules.simulate(plain, costs).makespan == 66.0  # docs/overlap.md
    assert by[("dualpipev", True)].step_s == schedules.simulate(paired, costs).makespan == 54.0
    assert (d.schedule, d.overlap) == ("dualpipev", True) and d.chosen.overlap
    assert by[("dualpipev", True)].a2a_hidden_s == 12.0 and by[("dualpipev", False)].a2a_s == 16.0
    line = d.table().splitlines()[-1]
    assert line.startswith("overlap: dualpipev m=8 with OVERLAPs 54000.000 ms against 66000.000 ms without: saves "
                           "12000.000 ms, 18.2% of the step")
    assert d.chosen.applied(PipelineConfig()).layout.overlap is True
    # without all-to-all the overlap buys nothing: the plain pairs win the tie, no overlap line
    free = choose_schedule([dataclasses.replace(c, a2a_f=0.0, a2a_b=0.0) for c in A2A], memory_limit_bytes=1e9,
                           microbatches=[8], schedule_names=["dualpipev"], num_ranks=2, ep=2)
    assert len(free.options) == 2 and not free.overlap and "overlap:" not in free.table()
    assert not any(o.overlap for o in _choose(A2A, ep=1).options)  # "auto": only at ep > 1
    assert not any(o.overlap for o in _choose(A2A, ep=2, overlap=False).options)
    forced = _choose(A2A, ep=2, overlap=True)
    assert all(o.overlap for o in forced.options) and any(name == "zbv" for name, _, _ in forced.skipped)


def test_a_trial_s_measured_all_to_alls_replace_the_estimate():
    measured = schedules.Costs(a2a_f=[0.2, 0.0], a2a_b=[0.4, 0.0])
    est = [StageCost(f=1.0, b=1.0, w=1.0, rows=8, a2a_f=0.2, a2a_b=0.1, a2a_f0=0.1, a2a_b0=0.05),
           StageCost(f=1.0, b=1.0, w=1.0, rows=8)]
    got = measured_exchanges(est, measured, rows=4)  # at 4 rows the estimate is 0.15 / 0.075
    assert (got[0].at(4).a2a_f, got[0].at(4).a2a_b) == pytest.approx((0.2, 0.4))
    assert (got[1].a2a_f, got[1].a2a_b) == (0.0, 0.0)
    blind = measured_exchanges([est[1], est[1]], measured, rows=4)  # no estimate: the measurement, linear in rows
    assert (blind[0].a2a_f, blind[0].a2a_b, blind[0].a2a_f0) == pytest.approx((0.4, 0.8, 0.0))
    assert measured_exchanges(est, schedules.Costs(), rows=4) == est


def test_plan_pipeline_estimates_the_moe_stages_all_to_alls_at_ep_2():
    cfg = GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=4, n_experts=4, top_k=2, expert_hidden=6)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, 16, (16, 6), generator=g) for _ in range(2))
    config = PipelineConfig.from_options(device="cpu", dp=2, ep=2, memory_limit_bytes=1 << 30)
    d = plan_pipeline(gpt_stages(cfg, 4), "dualpipev", config, (x, y), lm_loss, num_microbatches=4, repeats=1,
                      verbose=False)
    hidden = 2 * 6 * 8 * 4  # 2 rows x seq 6 x d_model 8 float32
    want = exchange_seconds(hidden, [2], 2, 5e-4, 1e9)  # one MoE block a stage, CPU's assumed link
    for c in d.stage_costs:
        assert (c.a2a_f, c.a2a_b) == pytest.approx(want[:2])
    assert {o.overlap for o in d.options} == {True, False}
    assert d.overlap == d.chosen.overlap
