"""Context parallelism with expert parallelism drawn from the replicas (Note [expert parallelism]
in actors/grid.py): a GPT-MoE at dp=2 x ep=2 x cp=2 trains equal to one process (losses rtol
1e-5, parameters rtol 1e-4 atol 1e-5), the experts' gradients summed over their EDP group's
replicas and CP ranks, with the auxiliary loss of the whole sequences (Note [auxiliary loss
under CP] in actors/moe_hooks.py)."""

from __future__ import annotations

import torch

import mpmd
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss

from tests.models import sgd
from tests.mpmd.moe.test_expert_parallel import _actor_state, _reference, _whole_state

AUX = 0.5  # large enough that a shard's own routed fractions would fail the comparison


def test_gpt_moe_at_dp2_ep2_cp2_trains_like_one_process(ray_session):
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=2, n_experts=4, top_k=2, expert_hidden=6)
    g = torch.Generator().manual_seed(5)
    data = [(torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g)) for _ in range(2)]
    with mpmd.Pipeline(gpt_stages(cfg, 1), schedule="1f1b", num_microbatches=1, loss_fn=lm_loss, optimizer=sgd,
                       num_actors=1, dp=2, ep=2, cp=2, moe_aux_loss_coef=AUX, device="cpu") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        got = pipe.engine.client.run_in_each(_actor_state, "reading the stages")
        metrics = pipe.moe_metrics
    assert len(got) == 4
    ref_losses, ref_state, _, _ = _reference(gpt_stages(cfg, 1), data, 2, aux=AUX)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[:2]), rtol=1e-5, atol=1e-6)
    state = _whole_state(got, 2, 2)
    assert state.keys() == ref_state.keys()
    for k, v in ref_state.items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{k}: {msg}")
    loads = {k: v for k, v in metrics.items() if k.endswith(".load")}
    assert loads and all(sum(v) == 4 * 8 * 2 for v in loads.values())  # every token of the batch x top_k, once
