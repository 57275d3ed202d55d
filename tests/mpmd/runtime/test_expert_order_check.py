"""The engine's pre-launch check knows the EP collectives (Note [expert all-to-alls in the order
model] in schedules/expert_order.py): what it models of a pipeline's MoE stages, and the
programs it refuses; no actor starts here."""

from __future__ import annotations

import pytest

import schedules
from mpmd.models.gpt import GPTConfig, gpt_stages
from mpmd.runtime.compile import compile_programs, pipeline_programs
from mpmd.runtime.config import PipelineConfig, recipe_of
from mpmd.runtime.transport import (check_before_launch, check_expert_order, check_nccl_order, expert_collectives,
                                    pipeline_experts)
from schedules import DeadlockError, Kind
from tests.mpmd.runtime.test_nccl_order_transport import CROSSED


def _moe(n_layers: int = 4) -> GPTConfig:
    return GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=n_layers, n_experts=4, top_k=2,
                     expert_hidden=6)


def test_what_the_check_models_of_a_pipelines_moe_stages():
    assert expert_collectives({0: 0, 1: 0}, 2) == []  # no MoE block
    assert expert_collectives({0: 1}, 1) == []  # ep=1 and nothing summed after the update: nothing to model
    exact, fallback = expert_collectives({0: 1, 1: 2}, 2, loads=True)
    assert (exact.exchanges(1, Kind.F), exact.exchanges(1, Kind.I), exact.exchanges(1, Kind.W)) == (6, 4, 0)
    assert (fallback.exchanges(1, Kind.I), fallback.exchanges(1, Kind.W)) == (4, 4)
    assert (exact.exchanges(0, Kind.I), exact.exchanges(0, Kind.W)) == (0, 2)  # stage 0: W does the whole backward
    stages = gpt_stages(_moe(), 2)
    got = pipeline_experts(stages, 2, recipe_of(PipelineConfig.from_options(dp=2, ep=2, moe_aux_loss_coef=0.01), 2))
    # each GPT-MoE stage holds two of the four layers' MoE blocks; loads and aux summed after the update
    assert [(e.ep, e.loads, e.aux, e.exchanges(1, Kind.F), e.exchanges(1, Kind.W)) for e in got] == [
        (2, True, True, 6, 0), (2, True, True, 6, 4)]
    assert pipeline_experts(stages, 1, recipe_of(PipelineConfig.from_options(dp=2), 2)) == []  # ep=1: today's order


def test_every_program_of_an_ep_pipeline_passes_before_launch_on_every_transport():
    experts = expert_collectives({0: 2, 1: 2}, 2, loads=True, aux=True)
    for name in ("1f1b", "interleaved-1f1b", "zb-h1", "zbv"):  # every one: tests/schedules/test_expert_order.py
        sched = schedules.get_schedule(name, 2, 4)
        programs = pipeline_programs(sched, 2)
        for requested, device, gpus in (("nccl", "cuda", 1.0), ("auto", "cpu", 0.0)):
            check_before_launch(requested, device, gpus, programs, sched, 2, experts)


def test_a_program_that_hangs_says_it_was_checked_with_the_exchanges():
    programs = compile_programs(CROSSED)
    experts = expert_collectives({0: 1, 1: 1}, 2)
    with pytest.raises(DeadlockError, match=r"could hang on NCCL with the EP all-to-alls \(ep=2; the split backward "
                                            r"exact: W exchanges nothing\)"):
        check_nccl_order("train", programs, CROSSED, 2, experts=experts)
    check_expert_order("train", programs, 2, experts)  # on gloo tags pair the messages; the EP order is one order
