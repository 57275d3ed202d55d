"""The memory model of MoE layers (``moe_layer_bytes``, ``rank_memory(ep=...)``) and the dry run's
plan of a MoE model (Note [dry-run memory] in mpmd/lm/dry_run.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import schedules
from mpmd.lm import load_config
from mpmd.lm import plan as lm_plan
from mpmd.lm.models import llama_spec
from mpmd.lm.plan import moe_layers, plan_schedule, simulate_plan, stage_flops, stage_params
from mpmd.planning import MoESpec, StageCost, moe_layer_bytes, rank_memory


def _hf_blocks():
    """Hugging Face's Qwen3-MoE and DeepSeek-V3 MoE blocks, tiny, and the MoESpec of each."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    qwen = Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=8,
                                                 num_experts_per_tok=2))
    deepseek = DeepseekV3MoE(DeepseekV3Config(hidden_size=16, moe_intermediate_size=8, n_routed_experts=8,
                                              num_experts_per_tok=2, n_shared_experts=2, n_group=2, topk_group=1))
    return [(qwen, MoESpec(num_experts=8, top_k=2, expert_intermediate_size=8)),
            (deepseek, MoESpec(num_experts=8, top_k=2, expert_intermediate_size=8, num_shared_experts=2))]


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_parameters_per_actor_are_the_hf_blocks_experts_over_ep_and_the_rest_whole(ep):
    for block, moe in _hf_blocks():
        experts = sum(p.numel() for p in block.experts.parameters())
        rest = sum(p.numel() for p in block.parameters()) - experts
        got = moe_layer_bytes(moe, hidden_size=16, tokens=32, ep=ep)
        assert (got.expert_params, got.replicated_params) == (experts // ep, rest)
        # fp32 weight + gradient + AdamW's two moments: 16 bytes each, whole for the experts under ZeRO-1 too
        zero = moe_layer_bytes(moe, hidden_size=16, tokens=32, ep=ep, dp=4, zero=1)
        assert zero.state_bytes == 16 * experts // ep + (8 + 8 / 4) * rest


def test_activations_and_all_to_all_buffers_scale_with_tokens_and_top_k():
    moe = MoESpec(num_experts=8, top_k=2, expert_intermediate_size=8)
    one, two = (moe_layer_bytes(moe, hidden_size=16, tokens=t, ep=2) for t in (32, 64))
    assert two.act_bytes == 2 * one.act_bytes and two.a2a_bytes == 2 * one.a2a_bytes
    assert one.a2a_bytes == 2 * 32 * 2 * 16 * 2.0  # the dispatch's and the combine's send buffers, 16-bit
    # per token: input 16, per slot 2 x 16 + 4 x 8, and the fp32 router's logits and probabilities (2 x 8 x 4 B)
    assert one.act_bytes == 32 * ((16 + 2 * (2 * 16 + 4 * 8)) * 2.0 + 2 * 8 * 4.0)
    skewed = moe_layer_bytes(moe, hidden_size=16, tokens=32, ep=2, imbalance=2.0)
    assert skewed.act_bytes > one.act_bytes and skewed.a2a_bytes == one.a2a_bytes


def test_bad_expert_shapes_are_refused():
    moe = MoESpec(num_experts=6, top_k=2, expert_intermediate_size=8)
    with pytest.raises(ValueError, match=r"ep=4 must divide the 6 experts"):
        moe_layer_bytes(moe, hidden_size=16, tokens=8, ep=4)
    with pytest.raises(ValueError, match=r"top_k \(9\) is more than num_experts \(8\)"):
        MoESpec(num_experts=8, top_k=9, expert_intermediate_size=8)


def test_rank_memory_counts_one_ep_share_of_the_experts_with_their_whole_optimizer_state():
    sched = schedules.get_schedule("1f1b", 2, 4)
    costs = [StageCost(f=1, b=1, w=1, act_bytes=10.0, param_bytes=1000.0, expert_bytes=600.0) for _ in range(2)]
    dense = rank_memory(sched, costs, optimizer_state_factor=1.0, expert_state_factor=2.0)
    for ep in (2, 4):
        split = rank_memory(sched, costs, optimizer_state_factor=1.0, ep=ep, expert_state_factor=2.0)
        assert [a - b for a, b in zip(dense, split)] == pytest.approx([600 * (1 - 1 / ep) * 4.0] * 2)
    plain = [dataclasses.replace(c, expert_bytes=0.0) for c in costs]
    assert rank_memory(sched, plain, 2.0) == rank_memory(sched, costs, 2.0)  # ep=1, one factor: as before


def _mixtral_spec(cfg, first_dense=0):
    spec = llama_spec(cfg.model, cfg.model.vocab_size or cfg.tokenizer.vocab_size)
    return dataclasses.replace(spec, hidden_size=32, num_heads=4, num_kv_heads=2, intermediate_size=24, vocab_size=64,
                               num_layers=3, moe=MoESpec(num_experts=4, top_k=2, expert_intermediate_size=16,
                                                         first_dense_layers=first_dense))


def test_stage_parameters_of_a_moe_decoder_equal_transformers_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = load_config("configs/debug.toml", [])
    spec = _mixtral_spec(cfg)
    with torch.device("meta"):
        model = MixtralForCausalLM(MixtralConfig(
            hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            num_local_experts=4, num_experts_per_tok=2, vocab_size=64, tie_word_embeddings=False))
    assert sum(stage_params(spec, [3])) == sum(p.numel() for p in model.parameters())
    # the first dense layer has the Llama MLP (intermediate 24) instead
    dense_first = _mixtral_spec(cfg, first_dense=1)
    assert [moe_layers(dense_first, [1, 2], s) for s in (0, 1)] == [0, 2]
    moe_mlp = 4 * 3 * 32 * 16 + 4 * 32
    assert stage_params(dense_first, [1, 2])[0] == stage_params(spec, [1, 2])[0] - moe_mlp + 3 * 32 * 24
    # FLOPs count the top_k experts a token goes to, not all of them
    flops = stage_flops(cfg, spec, stage_params(spec, [3]), [3])[0]
    tokens = cfg.optim.batch_size // cfg.parallel.microbatches * cfg.data.seq_len
    assert flops == pytest.approx(tokens * (6.0 * (sum(stage_params(spec, [3])) - 64 * 32 - 3 * 2 * 3 * 32 * 16)
                                            + 12.0 * 3 * 32 * cfg.data.seq_len))


def test_the_dry_runs_memory_counts_the_experts_once_per_ep_group(monkeypatch):
    cfg = load_config("configs/debug.toml", ["parallel.dp=2", "parallel.zero=1"])
    spec = _mixtral_spec(cfg)
    counts = [2, 1]
    params = stage_params(spec, counts)
    sched = plan_schedule(cfg)
    dense_spec = dataclasses.replace(spec, moe=None)
    _, _, dense = simulate_plan(cfg, dense_spec, sched, stage_params(dense_spec, counts), counts)
    _, _, ep1 = simulate_plan(cfg, spec, sched, params, counts)
    monkeypatch.setattr(lm_plan, "expert_parallel", lambda cfg: 2)  # parallel.ep comes with the MoE configs
    _, _, ep2 = simulate_plan(cfg, spec, sched, params, counts)
    assert all(m > d for m, d in zip(ep1, dense))
    # per MoE layer, half of the experts' 16 bytes per parameter (ZeRO-1 leaves their moments whole)
    experts = 4 * 3 * 32 * 16
    assert [a - b for a, b in zip(ep1, ep2)] == pytest.approx([c * experts / 2 * 16.0 for c in counts])
