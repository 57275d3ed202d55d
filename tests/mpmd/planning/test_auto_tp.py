"""schedule="auto" with tensor-parallel choices (Note [TP cost model] in mpmd/planning/tp.py):
tp as another dimension of the options, pure (no Ray, no measuring)."""

from __future__ import annotations

import dataclasses
import math

import pytest

import schedules
from mpmd.planning import StageCost, choose_schedule
from mpmd.planning.replan import corrected_costs, Trial
from mpmd.runtime import PipelineConfig

MS = [4]
NAMES = ["1f1b", "gpipe"]


def _costs(share: float = 1.0, params: float = 100.0) -> list[StageCost]:
    """Two stages of one sharded transformer layer each: compute 1 ms per F/I/W, 2 all-reduces
    each way of 1 kB."""
    return [StageCost(f=1e-3, b=1e-3, w=1e-3, param_bytes=params, act_bytes=10.0, out_bytes=1e3, tp_share=share,
                      tp_forward=2, tp_backward=2, tp_bytes=1e3) for _ in range(2)]


def test_a_single_tp_changes_nothing():
    plain = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES)
    one = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES, tp=1,
                          tp_latency_s=1.0, tp_bytes_per_s=1.0)
    assert plain.options == one.options and plain.tp == 1 and all(o.tp == 1 for o in plain.options)
    assert " tp " not in plain.table().splitlines()[1] and "x tp=" not in plain.table()


def test_tp_2_wins_when_compute_dominates_and_the_collectives_are_cheap():
    d = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES, tp=(1, 2),
                        tp_latency_s=1e-6, tp_bytes_per_s=1e10)
    assert d.tp == 2 and d.chosen.tp == 2
    assert {o.tp for o in d.options} == {1, 2} and len(d.options) == 2 * len(NAMES)
    by = {(o.schedule, o.tp): o for o in d.options}
    # All sharded: a rank's compute halves; 2 x (1e-6 + 1e3 / 1e10) per forward and backward on top.
    coll = 2 * (1e-6 + 2 * 0.5 * 1e3 / 1e10)
    one = schedules.simulate(schedules.get_schedule("1f1b", 2, 4), schedules.Costs(f=5e-4 + coll, b=1e-3 + coll, w=0.0))
    assert by[("1f1b", 2)].step_s == pytest.approx(one.makespan)
    assert by[("1f1b", 2)].step_s < by[("1f1b", 1)].step_s / 1.9
    table = d.table()
    assert table.splitlines()[1].split()[:4] == ["schedule", "actors", "tp", "m"]
    assert "on 2 pipeline ranks x tp=2 (4 actors per replica)" in table


def test_tp_1_wins_when_the_collectives_are_expensive():
    d = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES, tp=(1, 2),
                        tp_latency_s=1e-3, tp_bytes_per_s=1e6)  # 4 all-reduces of 2 ms per F: 8 ms > 0.5 ms saved
    assert d.tp == 1 and {o.tp for o in d.options} == {1, 2}
    assert min(o.step_s for o in d.options if o.tp == 2) > d.predicted_step_s


def test_a_memory_limit_only_tp_2_fits_picks_tp_2():
    """Per actor at tp=1: 100 B parameters x (1 + 1 + 2) = 400 B, plus activations; at tp=2 half
    the parameter state.  The collectives are expensive, so tp=1 would win on time."""
    costs = _costs()
    free = choose_schedule(costs, memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES, tp=(1, 2),
                           tp_latency_s=1e-3, tp_bytes_per_s=1e6)
    need = {t: min(o.peak_bytes for o in free.options if o.tp == t) for t in (1, 2)}
    assert need[2] == pytest.approx(need[1] - 200.0)
    d = choose_schedule(costs, memory_limit_bytes=need[1] - 1, microbatches=MS, schedule_names=NAMES, tp=(1, 2),
                        tp_latency_s=1e-3, tp_bytes_per_s=1e6, recompute=False)
    assert d.tp == 2 and d.chosen.fits and not any(o.fits for o in d.options if o.tp == 1)
    # A partly sharded stage keeps its whole part on every rank: 100 x (0.5 + 0.5 / 2) x 4 = 300 B.
    half = choose_schedule(_costs(share=0.5), memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES, tp=(1, 2))
    assert min(o.peak_bytes for o in half.options if o.tp == 2) == pytest.approx(need[1] - 100.0)
    with pytest.raises(ValueError, match="try tp=4"):
        choose_schedule(costs, memory_limit_bytes=10, microbatches=MS, schedule_names=NAMES, tp=(1, 2))


def test_the_chosen_option_sets_config_tp_to_an_int():
    config = PipelineConfig.from_options(tp=(2, 1, 2), tp_plan="auto")
    assert config.layout.tp == (1, 2) and config.layout.tp_choices == (1, 2)
    assert PipelineConfig.from_options(tp=(1,)).layout.tp == 1 and PipelineConfig.from_options(tp=[2], tp_plan="auto").layout.tp == 2
    d = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=MS, schedule_names=NAMES, tp=config.layout.tp)
    applied = d.chosen.applied(config)  # the count is the option's schedule's (build_schedule(..., m))
    assert applied.layout.tp == 2 and isinstance(applied.layout.tp, int) and d.chosen.num_microbatches == 4
    assert d.request["tp"] == (1, 2)  # a re-plan (replan.py) simulates the same choices


@pytest.mark.parametrize("tp,match", [((), "non-empty tuple of positive integers"), ((1, 0), "positive integers"),
                                      ((1, 2), "needs a plan")])
def test_tp_choices_are_checked(tp, match):
    with pytest.raises(ValueError, match=match):
        PipelineConfig.from_options(tp=tp)


def test_calibration_compares_a_trial_with_one_tp_ranks_prediction():
    """A trial at tp=2 measures one TP rank: the stage's correction divides the measured
    times by the per-rank prediction (sharded share / 2 plus the collectives), so a trial
    that ran as predicted corrects nothing."""
    link = dict(tp_latency_s=1e-4, tp_bytes_per_s=1e8)
    d = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=MS, schedule_names=["1f1b"], tp=2, **link)
    rank = [c.on_tp_rank(2, 1e-4, 1e8) for c in d.model_costs]
    assert rank[0].f == pytest.approx(5e-4 + 2 * (1e-4 + 1e3 / 1e8)) and rank[0].w == pytest.approx(5e-4)
    assert rank[0].param_bytes == 50.0 and rank[0].tp_share == 0.0
    measured = schedules.Costs(f=[c.f for c in rank], b=[c.full for c in rank], w=0.0)
    fixed = corrected_costs(d, Trial(costs=measured, step_s=1.0))
    assert [c.f for c in fixed] == pytest.approx([c.f for c in d.model_costs])
    assert [c.full for c in fixed] == pytest.approx([c.full for c in d.model_costs])
    assert math.isclose(d.model_costs[0].on_tp_rank(1, 1.0, 1.0).f, d.model_costs[0].f)
    assert dataclasses.replace(d.model_costs[0], tp_share=0.0).params_at(2) == 100.0


def test_plan_pipeline_reads_the_resolved_plans_and_chooses_tp():
    """The Pipeline's path, on the controller only: stages measured, the plans
    mpmd.tensor_parallel resolves read for each stage's share and collectives, tp a choice."""
    import torch

    from mpmd.models import GPTConfig, gpt_stages, lm_loss
    from mpmd.planning import plan_pipeline
    from mpmd.tensor_parallel import resolve_plans

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    stages = gpt_stages(cfg, 2)
    x = torch.randint(0, 32, (4, 8))
    config = PipelineConfig.from_options(tp=(1, 2), tp_plan="auto", memory_limit_bytes=1 << 30)
    d = plan_pipeline(stages, "1f1b", config, (x, x), lm_loss, num_microbatches=2, repeats=1, verbose=False,
                      resolve_tp=resolve_plans)
    assert {o.tp for o in d.options} == {1, 2} and d.num_microbatches == 2
    first, last = d.model_costs
    # Stage 0: the embedding (1 all-reduce forward) and a block's MLP (1 and 1); stage 1: an MLP, the head (0, 1).
    assert (first.tp_forward, first.tp_backward, last.tp_forward, last.tp_backward) == (2, 1, 1, 2)
    assert 0.5 < first.tp_share < 1.0 and 0.5 < last.tp_share < 1.0
    assert first.tp_bytes == first.out_bytes > 0 and last.tp_bytes == last.in_bytes
    assert d.chosen.applied(config).layout.tp == d.tp


def test_the_profile_of_resolved_plans_matches_the_built_in_names():
    from mpmd.models import GPTConfig, gpt_stages
    from mpmd.planning.tp import tp_profile
    from mpmd.tensor_parallel import resolve_plans

    stages = gpt_stages(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2), 2)
    for stage, plan in zip(stages, resolve_plans(stages, "auto", 2)):
        assert tp_profile(stage, plan) == tp_profile(stage, "auto")
    transformers = pytest.importorskip("transformers")
    import mpmd

    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    hf = mpmd.split(llama, 2, verbose=False)
    for stage, plan in zip(hf, resolve_plans(hf, "auto", 2)):
        got = tp_profile(stage, plan)
        # A layer: 2 forward, 2 backward (attention's and the MLP's prepared inputs); the embedding 1
        # forward, the head 1 backward.
        assert got == tp_profile(stage, "auto") and (got.forward, got.backward) in ((3, 2), (2, 3))


def test_pipeline_with_tp_choices_starts_the_one_that_fits(ray_session, capsys):
    """Pipeline(tp=(1, 2)) with a memory limit only tp=2 meets: the engine runs 2 ranks x tp=2
    with an int config.tp, and its first losses are one process's."""
    import torch

    import mpmd
    from mpmd.models import GPTConfig, gpt_stages, lm_loss
    from mpmd.planning import plan_pipeline
    from mpmd.tensor_parallel import resolve_plans
    from tests.models import reference_train, sgd

    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    stages = gpt_stages(cfg, 2)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 32, (4, 8), generator=g), torch.randint(0, 32, (4, 8), generator=g)) for _ in range(2)]
    base = PipelineConfig.from_options(tp=(1, 2), tp_plan="auto", device="cpu", memory_limit_bytes=1 << 30)
    free = plan_pipeline(stages, "1f1b", base, data[0], lm_loss, num_microbatches=2, repeats=1, verbose=False,
                         resolve_tp=resolve_plans)
    limit = int(min(o.peak_bytes for o in free.options if o.tp == 1)) - 1
    assert min(o.peak_bytes for o in free.options if o.tp == 2) < limit
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, tp=(1, 2), tp_plan="auto", sample=data[0],
                       loss_fn=lm_loss, optimizer=sgd, device="cpu", memory_limit_bytes=limit) as pipe:
        assert pipe.auto_decision.tp == 2 and pipe.config.layout.tp == 2 and len(pipe.actors) == 4
        out = capsys.readouterr().out  # Note [calibrated tp]: no trial of a tp > 1 plan (yet)
        assert "x tp=2" in out and "not calibrated on the actors" in out
        losses = [pipe.step(x, y) for x, y in data]
    _, ref_losses = reference_train(stages, data, 2, lm_loss, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_a_tp_choice_the_plan_cannot_apply_is_left_out_with_the_reason():
    import torch

    from mpmd.models import GPTConfig, gpt_stages, lm_loss
    from mpmd.planning import plan_pipeline
    from mpmd.tensor_parallel import resolve_plans

    stages = gpt_stages(GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=2), 2)
    x = torch.randint(0, 32, (4, 8))
    config = PipelineConfig.from_options(tp=(1, 3), tp_plan="auto", memory_limit_bytes=1 << 30)
    d = plan_pipeline(stages, "1f1b", config, (x, x), lm_loss, num_microbatches=2, repeats=1, verbose=False,
                      resolve_tp=resolve_plans)
    assert {o.tp for o in d.options} == {1} and d.tp == 1
    assert [why for what, _, why in d.skipped if what == "tp=3"][0].count("not divisible by 3")
    with pytest.raises(ValueError, match="no tp choice applies to these stages: tp=3: .*not divisible by 3"):
        plan_pipeline(stages, "1f1b", PipelineConfig.from_options(tp=3, tp_plan="auto", memory_limit_bytes=1 << 30), (x, x), lm_loss,
                      num_microbatches=2, repeats=1, verbose=False, resolve_tp=resolve_plans)


def test_calibration_stays_at_the_tp_the_controller_chose():
    """Note [calibrated tp]: from tp=(1, 2) the controller picks tp=1 (expensive collectives);
    the trials and the re-plan stay at tp=1, on stand-in engines."""
    from mpmd.planning.replan import decide_on_actors
    from mpmd.runtime import build_schedule

    d = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=[1, 2, 4], schedule_names=NAMES,
                        tp=(1, 2), tp_latency_s=1e-3, tp_bytes_per_s=1e6)
    assert d.tp == 1 and {o.tp for o in d.options} == {1, 2}

    class Engine:
        def __init__(self, option):
            self.option = option
            self.schedule = build_schedule(option.schedule, 2, PipelineConfig(), option.num_microbatches)

        def shutdown(self):
            pass

    def trial(engine):
        o = engine.option
        assert o.tp == 1
        c = [x.on_tp_rank(o.tp, 1e-3, 1e6) for x in d.model_costs]
        return Trial(schedules.Costs(f=[x.f for x in c], b=[x.full for x in c], w=0.0, task=1e-4), 0.01)

    new, engine = decide_on_actors(d, Engine(d.chosen), trial=trial, make_engine=Engine,
                                   measure_at=lambda e, o: trial(Engine(o)), sweep=2)
    assert new.tp == 1 and {o.tp for o in new.options} == {1} and engine.option.tp == 1
    assert {o.tp for o in new.provisional.options} == {1, 2}
    # A chosen tp above 1 runs the controller's plan, with the reason in the table.
    two = choose_schedule(_costs(), memory_limit_bytes=1e9, microbatches=[2], schedule_names=NAMES, tp=2)
    running = Engine(two.chosen)
    kept, same = decide_on_actors(two, running, trial=lambda e: pytest.fail("no trial at tp=2"), make_engine=Engine)
    assert kept.chosen == two.chosen and same is running and "not calibrated on the actors" in kept.table()
