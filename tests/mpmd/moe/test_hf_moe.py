"""Hugging Face mixture-of-experts models under ``mpmd.split`` (Note [Hugging Face MoE] in
mpmd/planning/hf_moe.py): a split Qwen3-MoE, Mixtral and DeepSeek-V3 train on actors exactly as
the model trains in one process (gradient accumulation, float32); weights load from the Hub's
one-tensor-per-expert files and from fused ones, and the export is what ``from_pretrained``
loads, with equal logits; what cannot run split is refused with the reason."""

from __future__ import annotations

import copy

import pytest
import torch

import mpmd
from mpmd.planning import causal_lm_loss

from tests.models import reference_train, sgd

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICROBATCHES, STEPS = 64, 8, 4, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=SEQ)


def tiny(family: str, seed: int = 0, **options):
    """A tiny model of ``family`` built from its config (nothing downloaded), eager experts."""
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
                                          num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=True, mlp_only_layers=[3], **options)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=16, num_key_value_heads=1, num_local_experts=4,
                                         num_experts_per_tok=2, tie_word_embeddings=True, **options)
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                            num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                                            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                            **options)
        cls = transformers.DeepseekV3ForCausalLM
    model = cls._from_config(cfg, experts_implementation="eager")
    if family == "deepseek_v3":  # a router bias that changes the choice (aux-loss-free balancing has moved it)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def batches(batch: int):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[0, :3] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, labels, {"attention_mask": mask}))
    return out


def hf_forward(model, ids, side):
    return model(ids, attention_mask=side["attention_mask"], use_cache=False).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_split_moe_model_trains_as_the_model_does(ray_session, family):
    model = tiny(family)
    data = batches(2 * MICROBATCHES)
    ref_model, ref_losses = reference_train(None, data, MICROBATCHES, causal_lm_loss, sgd, model=model,
                                            forward=hf_forward)
    stages = mpmd.split(model, num_stages=2, verbose=False)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=causal_lm_loss,
                       optimizer=sgd, num_actors=2, device="cpu", num_cpus=0.25) as pipe:
        losses = pipe.fit(data, progress=False)
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    want = ref_model.state_dict()
    assert sorted(state) == sorted(want), "the pipeline's state dict has the model's own keys"
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    moved = [k for k in want if "experts" in k and not torch.equal(want[k], model.state_dict()[k])]
    assert moved, "the experts trained"
