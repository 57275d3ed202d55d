"""Qwen3 at tp=2 x pp=2 through the Pipeline equals one process: its per-head q/k norms share
one weight across heads, so under a colwise q/k their gradient is a partial sum per actor
until the plan says so (Note [per-head norms] in mpmd/tensor_parallel/builtin.py).  Without
the norms in the plan the norms' steps are about half what they should be."""

from __future__ import annotations

import copy

import pytest
import torch

import mpmd
from mpmd.planning import causal_lm_loss

from tests.mpmd.tensor_parallel.test_tensor_parallel import (MICROBATCHES, LogitsOnly, batches, reference, sgd_foreach,
                                                              train)


def test_qwen3_tp2_equals_single_process(ray_session):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=8, tie_word_embeddings=False)
    model = transformers.Qwen3ForCausalLM(cfg)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    stages = mpmd.split(model, num_stages=2, verbose=False)
    data = batches(64, 2 * MICROBATCHES)
    losses, state, _, _ = train(stages, data, causal_lm_loss, sgd_foreach, schedule="1f1b")  # CUDA's kernels
    ref, ref_losses = reference(None, data, MICROBATCHES, causal_lm_loss, sgd_foreach,
                                model=LogitsOnly(copy.deepcopy(model)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    want = ref.lm.state_dict()
    assert set(state) == set(want)
    for key, got in state.items():
        torch.testing.assert_close(got, want[key], rtol=1e-4, atol=1e-5)
    # The norms' steps are small next to their weights: compare the steps themselves (without
    # the norms in the plan, each actor's step is about half the true one).
    norms = [k for k in state if k.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 8
    for key in norms:
        step = want[key] - init[key]
        assert step.abs().max() > 1e-5
        torch.testing.assert_close(state[key] - init[key], step, rtol=1e-3, atol=1e-7)
