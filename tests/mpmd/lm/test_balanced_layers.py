"""``parallel.layers`` (Note [balanced layers] in mpmd/lm/plan.py): the stages' parameter
counts the search uses equal the built stages'; "balanced" finds the fastest split that fits
(checked against every split); the configs that cannot work are refused; the dry run says
what it chose, or what balancing would gain."""

from __future__ import annotations

import itertools
import re

import pytest

from mpmd.lm import load_config
from mpmd.lm.config_io import ConfigError
from mpmd.lm.dry_run import dry_run
from mpmd.lm.models import layer_counts, llama_spec, meta_stages, param_counts, stage_factories
from mpmd.lm.plan import balanced_layers, plan_schedule, simulate_plan, stage_flops, stage_layer_counts, stage_params

# The debug model with 8 layers and a head as costly as 4 of them (vocab 2048 x hidden 64).
WIDE_HEAD = ["model.num_layers=8", "model.vocab_size=2048", "parallel.microbatches=4", "optim.batch_size=8"]


def _spec(cfg):
    return llama_spec(cfg.model, cfg.model.vocab_size or cfg.tokenizer.vocab_size)


@pytest.mark.parametrize("counts", [[1, 3], [3, 1], [2, 1, 1]])
def test_stage_params_equal_the_built_stages(counts):
    cfg = load_config("configs/debug.toml", [f"parallel.stages={len(counts)}"])
    spec = _spec(cfg)
    stages = meta_stages(stage_factories(spec, len(counts), cfg.data.seq_len, counts=counts))
    assert stage_params(spec, counts) == param_counts(stages)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    assert [list(s.layer_indices) for s in stages] == [list(range(a, a + c)) for a, c in zip(starts, counts)]


def _every_split(cfg, spec):
    """(memory overflow, predicted step) of every split into positive counts, by brute force."""
    p, n = cfg.parallel, spec.num_layers
    sched = plan_schedule(cfg)
    equal = layer_counts(n, p.stages)
    unit = max(stage_flops(cfg, spec, stage_params(spec, equal), equal))
    limit = p.memory_limit_gb * 2 ** 30 if p.memory_limit_gb else float("inf")
    out = {}
    for cuts in itertools.combinations(range(1, n), p.stages - 1):
        counts = [b - a for a, b in zip((0,) + cuts, cuts + (n,))]
        result, _, memory = simulate_plan(cfg, spec, sched, stage_params(spec, counts), counts, unit)
        out[tuple(counts)] = (max(0.0, max(memory) - limit), result.makespan)
    return out


@pytest.mark.parametrize("schedule, stages", [("1f1b", 3), ("zbv", 4), ("interleaved-1f1b", 4)])
def test_balanced_is_the_fastest_split(schedule, stages):
    cfg = load_config("configs/debug.toml", WIDE_HEAD + [f"parallel.schedule={schedule}", f"parallel.stages={stages}"])
    spec = _spec(cfg)
    every = _every_split(cfg, spec)
    counts, before, after = balanced_layers(cfg, spec, plan_schedule(cfg))
    best = min(t for _, t in every.values())
    assert after == pytest.approx(best, rel=1e-12) and every[tuple(counts)][1] == pytest.approx(after, rel=1e-12)
    assert before == pytest.approx(every[tuple(layer_counts(8, stages))][1], rel=1e-12)
    assert after < 0.95 * before  # the head is worth 4 layers: the equal split is far from the best
    assert counts[-1] < 8 // stages  # the head's stage gives layers away


def test_balanced_keeps_within_the_memory_limit():
    """A limit the fastest split exceeds: the fastest of those that fit."""
    base = WIDE_HEAD + ["parallel.schedule=1f1b", "parallel.stages=3"]
    cfg = load_config("configs/debug.toml", base)
    spec = _spec(cfg)
    every = _every_split(cfg, spec)
    fastest = min(every, key=lambda c: every[c][1])
    memory = {c: simulate_plan(cfg, spec, plan_schedule(cfg), stage_params(spec, list(c)), list(c))[2] for c in every}
    limit = sorted(max(m) for m in memory.values())[len(memory) // 2]  # half the splits fit
    assert max(memory[fastest]) > limit
    tight = load_config("configs/debug.toml", base + [f"parallel.memory_limit_gb={limit / 2 ** 30!r}"])
    counts, _, after = balanced_layers(tight, spec, plan_schedule(tight))
    assert max(memory[tuple(counts)]) <= limit
    assert after == pytest.approx(min(every[c][1] for c in every if max(memory[c]) <= limit), rel=1e-12)


def test_layers_from_the_config():
    cfg = load_config("configs/debug.toml", ["parallel.layers=[1, 3]"])
    assert cfg.parallel.layers == (1, 3) and stage_layer_counts(cfg, _spec(cfg)) == [1, 3]
    assert stage_layer_counts(load_config("configs/debug.toml", []), _spec(cfg)) == [2, 2]
    said = []
    wide = load_config("configs/debug.toml", WIDE_HEAD + ["parallel.layers=balanced"])
    counts = stage_layer_counts(wide, _spec(wide), said.append)
    assert counts[1] < counts[0] and said and f"pin them with parallel.layers = {counts}" in said[0]


@pytest.mark.parametrize("overrides, message", [
    (["parallel.layers=[1, 2]"], r"parallel.layers = \[1, 2\] gives 3 decoder layers, but the model has 4"),
    (["parallel.layers=[4]"], r"parallel.layers = \[4\] must give each of the 2 stages \(parallel.stages\) at least"),
    (["parallel.layers=[0, 4]"], r"must give each of the 2 stages"),
    (["parallel.layers=even"], r"parallel.layers = 'even' is not one of 'equal', 'balanced'"),
    (["parallel.layers=3"], r"parallel.layers must be a string or a list of integers, got 3 \(int\)"),
    (["parallel.layers=balanced", "parallel.schedule=auto"], r"balances the layers for one schedule, but "
                                                             r"parallel.schedule is \"auto\": name the schedule"),
    (["parallel.layers=[1, 3]", "model.family=gpt"], r"parallel.layers = \(1, 3\) needs model.family = \"llama\""),
])
def test_bad_layers_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", overrides)


def test_the_dry_run_says_what_balancing_gains():
    equal = dry_run(load_config("configs/debug.toml", WIDE_HEAD))
    assert [len(x) for x in equal.layers] == [4, 4]
    hint = re.search(r'parallel.layers = "balanced" would give \[(\d+), (\d+)\]: predicted step ([0-9.]+) .* '
                     r'against ([0-9.]+) with equal layers', "\n".join(equal.notes))
    assert hint and int(hint[2]) < int(hint[1]) and float(hint[3]) < 0.95 * float(hint[4])
    balanced = dry_run(load_config("configs/debug.toml", WIDE_HEAD + ["parallel.layers=balanced"]))
    assert [len(x) for x in balanced.layers] == [int(hint[1]), int(hint[2])]
    assert balanced.idle < equal.idle  # the ranks wait less for the head's stage
    assert not dry_run(load_config("configs/debug.toml", ["parallel.layers=[2, 2]"])).notes


@pytest.mark.parametrize("schedule, stages", [("interleaved-1f1b", 4), ("dualpipev", 4)])
def test_the_plan_simulates_the_programs_the_actors_run(schedule, stages):
    """Note [balanced layers]: what the dry run and the search simulate is, instruction for
    instruction, what the Pipeline ships to its actors."""
    from mpmd.profiler import lowered_from_programs
    from mpmd.runtime import TRAIN
    from mpmd.runtime.compile import pipeline_programs

    from mpmd.lm.plan import lowered

    cfg = load_config("configs/debug.toml", WIDE_HEAD + [f"parallel.schedule={schedule}", f"parallel.stages={stages}"])
    sched = plan_schedule(cfg)
    shipped = lowered_from_programs(sched, pipeline_programs(sched)[TRAIN])
    assert lowered(cfg, sched).ranks == shipped.ranks
