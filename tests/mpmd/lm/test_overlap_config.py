"""``mpmd train``'s ``parallel.overlap`` (docs/overlap.md) and what the dry run says of the
experts' all-to-alls and the overlap (Note [all-to-all estimate] in mpmd/planning/a2a.py)."""

from __future__ import annotations

import pytest

import schedules
from mpmd.lm import load_config
from mpmd.lm.dry_run import dry_run
from mpmd.lm.plan import plan_schedule, stage_exchanges
from mpmd.lm.recipe import pipeline_options
from mpmd.planning.a2a import exchange_seconds

MOE = ["parallel.dp=2", "parallel.ep=2", "parallel.stages=4", "run.peak_flops=1e10"]


def _overlaps(sched) -> int:
    return sum(a.kind is schedules.Kind.OVERLAP for acts in sched.ranks for a in acts)


def test_parallel_overlap_reaches_the_pipeline_and_bad_values_are_refused_at_load():
    cfg = load_config("configs/qwen3_moe_debug.toml", MOE + ['parallel.schedule="dualpipev"'])
    assert cfg.parallel.overlap == "auto" and pipeline_options(cfg.parallel, cfg.optim)["overlap"] == "auto"
    assert _overlaps(plan_schedule(cfg)) > 0  # "auto": dualpipev's pairs at ep > 1
    off = load_config("configs/qwen3_moe_debug.toml", MOE + ['parallel.schedule="dualpipev"', "parallel.overlap=false"])
    assert pipeline_options(off.parallel, off.optim)["overlap"] is False and _overlaps(plan_schedule(off)) == 0
    with pytest.raises(ValueError, match=r"parallel.overlap = true runs a schedule's forward-backward pairs overlapped, "
                                         r"but parallel.schedule = '1f1b' has none; use schedule = 'dualpipev'"):
        load_config("configs/qwen3_moe_debug.toml", ["parallel.overlap=true"])
    with pytest.raises(ValueError, match=r"parallel.overlap must be \"auto\", true or false, got 'yes'"):
        load_config("configs/qwen3_moe_debug.toml", ['parallel.overlap="yes"'])


def test_the_dry_run_charges_the_all_to_alls_and_says_what_the_overlap_hides():
    cfg = load_config("configs/qwen3_moe_debug.toml", MOE + ['parallel.schedule="dualpipev"'])
    plan = dry_run(cfg)
    # 16 rows / (4 microbatches x dp 2) x 64 tokens x hidden 64 x 4 bytes; one MoE layer of top 2 a stage
    want = exchange_seconds(2 * 64 * 64 * 4.0, [2], 2, 5e-4, 1e9)[:2]
    assert stage_exchanges(cfg, plan.spec, [1, 1, 1, 1]) == [pytest.approx(want)] * 4
    line = next(n for n in plan.notes if n.startswith("all-to-all (ep=2"))
    per_step = 4 * 2 * sum(want)  # 4 microbatches x 2 stages a rank, a forward and a backward each
    assert f"{per_step:.3g} s per step on the busiest rank; dualpipev with its pairs overlapped hides " in line
    plain = dry_run(load_config("configs/qwen3_moe_debug.toml", MOE + ['parallel.schedule="dualpipev"',
                                                                       "parallel.overlap=false"]))
    assert plan.step_time_s < plain.step_time_s  # the overlap hides some of the all-to-all
    assert f"step {plan.step_time_s:.3g} s against {plain.step_time_s:.3g} s without" in line
    assert "not used: set parallel.overlap = true" in next(n for n in plain.notes if n.startswith("all-to-all"))
    dense = dry_run(load_config("configs/qwen3_moe_debug.toml", MOE[:1] + MOE[2:]))  # ep=1: nothing to say
    assert not any(n.startswith("all-to-all") for n in dense.notes)
