"""Tests for the TeraPipe token-slicing planner (schedules/slicing.py)."""

from __future__ import annotations

import math
import random

import pytest

from schedules.slicing import (
    CostModel,
    SlicePlan,
    plan_slices,
    slicing_time,
    uniform_slices,
)


def attention_cost(length, context):
    return length * context + length * (length + 1) / 2 + 3.0


def linear_cost(length, context):
    return 2.0 * length + 1.0


def constant_cost(length, context):
    return 1.0


def sqrt_cost(length, context):
    return math.sqrt(length) * (1 + 0.1 * context) + 0.5


def random_table_cost(seed):
    rng = random.Random(seed)
    table = {}

    def cost(length, context):
        if (length, context) not in table:
            table[(length, context)] = rng.choice([0.0, 0.5, 1.0, 2.5]) + rng.random() * length
        return table[(length, context)]

    return cost


def compositions(units):
    """All ordered ways to write ``units`` as a sum of positive integers."""
    for mask in range(1 << (units - 1)):
        parts, last = [], 0
        for i in range(1, units):
            if mask >> (i - 1) & 1:
                parts.append(i - last)
                last = i
        parts.append(units - last)
        yield parts


def brute_force(seq_len, cost, granularity, stage_counts):
    """Best objective for each K, found by enumerating every slicing."""
    best = {k: math.inf for k in stage_counts}
    for parts in compositions(seq_len // granularity):
        times, context = [], 0
        for p in parts:
            times.append(cost(p * granularity, context))
            context += p * granularity
        total, peak = sum(times), max(times)
        for k in stage_counts:
            best[k] = min(best[k], total + (k - 1) * peak)
    return best


COSTS = {
    "attention": lambda: attention_cost,
    "linear": lambda: linear_cost,
    "constant": lambda: constant_cost,
    "sqrt": lambda: sqrt_cost,
    "random0": lambda: random_table_cost(0),
    "random1": lambda: random_table_cost(1),
}


@pytest.mark.parametrize("cost_name", sorted(COSTS))
@pytest.mark.parametrize(
    "seq_len,granularity",
    [(1, 1), (2, 1), (3, 1), (5, 1), (8, 1), (11, 1), (16, 1), (2, 2), (8, 2), (16, 2), (12, 3), (16, 4)],
)
def test_plan_matches_brute_force(cost_name, seq_len, granularity):
    cost = COSTS[cost_name]()
    stage_counts = (1, 2, 3, 4)
    expected = brute_force(seq_len, cost, granularity, stage_counts)
    for k in stage_counts:
        plan = plan_slices(seq_len, k, cost, granularity=granularity)
        assert isinstance(plan, SlicePlan)
        assert plan.total_time == pytest.approx(expected[k], abs=1e-9)
        assert slicing_time(plan.slices, k, cost) == pytest.approx(plan.total_time, abs=1e-9)
        assert sum(plan.slices) == seq_len
        assert all(s > 0 and s % granularity == 0 for s in plan.slices)
        assert isinstance(plan.slices, tuple)


def test_plan_is_frozen():
    plan = plan_slices(4, 2, attention_cost)
    with pytest.raises(AttributeError):
        plan.total_time = 0.0


def test_single_stage_with_overhead_uses_one_slice():
    # With no pipeline fill cost and per-slice overhead, one big slice is optimal.
    assert plan_slices(16, 1, linear_cost).slices == (16,)


def test_deeper_pipeline_prefers_more_slices():
    shallow = plan_slices(64, 2, attention_cost, granularity=4)
    deep = plan_slices(64, 16, attention_cost, granularity=4)
    assert len(deep.slices) >= len(shallow.slices)
    assert len(deep.slices) > 1
    # Causal attention makes later slices more expensive, so they get shorter.
    assert deep.slices[0] >= deep.slices[-1]


def test_plan_is_fast_enough_for_realistic_sizes():
    model = CostModel(a0=1e-3, a1=1e-5, a2=0.0, a3=2e-8)
    plan = plan_slices(2048, 8, model, granularity=16)  # 128 grid units
    assert sum(plan.slices) == 2048
    assert plan.total_time <= slicing_time(uniform_slices(2048, 8, 16), 8, model) + 1e-12


def test_uniform_slices():
    assert uniform_slices(10, 3) == (4, 3, 3)
    assert uniform_slices(12, 4) == (3, 3, 3, 3)
    assert uniform_slices(20, 3, granularity=2) == (8, 6, 6)
    assert uniform_slices(8, 1) == (8,)
    assert uniform_slices(8, 4, granularity=2) == (2, 2, 2, 2)
    for seq_len, n, g in [(96, 5, 4), (17, 17, 1), (64, 7, 8)]:
        parts = uniform_slices(seq_len, n, g)
        assert len(parts) == n and sum(parts) == seq_len
        assert all(p % g == 0 and p > 0 for p in parts)
        assert max(parts) - min(parts) <= g


def test_uniform_slices_errors():
    with pytest.raises(ValueError, match="at most 4 slices"):
        uniform_slices(8, 5, granularity=2)
    with pytest.raises(ValueError, match="not divisible by granularity=4"):
        uniform_slices(10, 2, granularity=4)
    with pytest.raises(ValueError, match="num_slices must be a positive integer"):
        uniform_slices(10, 0)
    with pytest.raises(ValueError, match="seq_len must be a positive integer"):
        uniform_slices(0, 1)


def test_slicing_time():
    # times: cost(2,0)=2*0+3+3=6, cost(3,2)=6+6+3=15 -> 21 + 2*15
    assert slicing_time([2, 3], 3, attention_cost) == pytest.approx(51.0)
    assert slicing_time((5,), 1, linear_cost) == pytest.approx(11.0)
    with pytest.raises(ValueError, match="at least one slice"):
        slicing_time([], 2, linear_cost)
    with pytest.raises(ValueError, match="every slice length must be a positive integer"):
        slicing_time([2, 0], 2, linear_cost)
    with pytest.raises(ValueError, match="num_stages must be a positive integer"):
        slicing_time([2], 0, linear_cost)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(seq_len=0, num_stages=2), "seq_len must be a positive integer, got 0"),
        (dict(seq_len=-4, num_stages=2), "seq_len must be a positive integer, got -4"),
        (dict(seq_len=8, num_stages=0), "num_stages must be a positive integer, got 0"),
        (dict(seq_len=8, num_stages=2, granularity=0), "granularity must be a positive integer"),
        (dict(seq_len=8, num_stages=2, granularity=-2), "granularity must be a positive integer"),
    ],
)
def test_plan_rejects_bad_sizes(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_slices(cost=linear_cost, **kwargs)


def test_plan_rejects_indivisible_granularity():
    with pytest.raises(ValueError, match=r"seq_len=100 is not divisible by granularity=8") as info:
        plan_slices(100, 2, linear_cost, granularity=8)
    message = str(info.value)
    assert "pad the sequence to 104" in message
    assert "1, 2, 4, 5" in message


@pytest.mark.parametrize(
    "bad_value,match",
    [(-1.0, r"returned -1\.0"), (math.nan, "returned nan"), (math.inf, "returned inf")],
)
def test_plan_rejects_bad_cost(bad_value, match):
    def cost(length, context):
        return bad_value if context == 2 else 1.0

    with pytest.raises(ValueError, match=match + ".*finite, non-negative"):
        plan_slices(4, 2, cost)


def test_zero_cost_is_allowed():
    plan = plan_slices(6, 3, lambda length, context: 0.0)
    assert plan.total_time == 0.0
    assert sum(plan.slices) == 6


def test_cost_model_call():
    model = CostModel(1.0, 2.0, 3.0, 4.0)
    assert model(5, 7) == pytest.approx(1 + 10 + 21 + 140)
    with pytest.raises(AttributeError):
        model.a0 = 0.0


def test_cost_model_fit_recovers_coefficients():
    truth = CostModel(a0=2e-3, a1=3e-5, a2=1e-6, a3=4e-9)
    samples = [(l, c, truth(l, c)) for l in (16, 64, 256, 1024) for c in (0, 128, 1024, 4096)]
    fitted = CostModel.fit(samples)
    for name in ("a0", "a1", "a2", "a3"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6)


def test_cost_model_fit_averages_noise():
    truth = CostModel(a0=1.0, a1=0.5, a2=0.25, a3=0.01)
    rng = random.Random(3)
    samples = []
    for l in range(1, 9):
        for c in range(0, 40, 5):
            noise = rng.random() * 0.01
            for sign in (1, -1):  # symmetric noise cancels exactly in least squares
                samples.append((l, c, truth(l, c) + sign * noise))
    fitted = CostModel.fit(samples)
    assert fitted.a0 == pytest.approx(1.0, abs=1e-9)
    assert fitted.a3 == pytest.approx(0.01, abs=1e-9)
    plan = plan_slices(16, 4, fitted)
    assert sum(plan.slices) == 16


def test_cost_model_fit_errors():
    with pytest.raises(ValueError, match="at least 4 .* got 3.*measure more distinct"):
        CostModel.fit([(1, 0, 1.0), (2, 0, 2.0), (3, 1, 3.0)])
    with pytest.raises(ValueError, match="singular.*measure more distinct"):
        CostModel.fit([(4, 8, 1.0)] * 10)
    with pytest.raises(ValueError, match="singular"):
        CostModel.fit([(l, 0, float(l)) for l in range(1, 10)])  # context never varies
    with pytest.raises(ValueError, match="singular"):
        # length*context is a linear combination of the other features here.
        CostModel.fit([(l, 2 * l, float(l)) for l in range(1, 10)])


def test_module_is_pure_stdlib():
    import ast
    import pathlib

    import schedules.slicing as mod

    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"torch", "ray", "numpy"}
    assert set(mod.__all__) == {"SlicePlan", "CostModel", "plan_slices", "uniform_slices", "slicing_time"}
