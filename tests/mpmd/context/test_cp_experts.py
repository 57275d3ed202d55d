"""Context parallelism with expert parallelism drawn from a stage's dp x cp actors (Note [expert
parallelism] in actors/grid.py): a GPT-MoE at dp=2 x ep=2 x cp=2 (each replica's two CP ranks an
EP group) and at dp=1 x cp=2 x ep=2 trains equal to one process (losses rtol 1e-5, parameters rtol
1e-4 atol 1e-5), the experts' gradients summed over their EDP group, with the auxiliary loss of the
whole sequences (Note [auxiliary loss under CP] in actors/moe_hooks.py); a checkpoint at dp=1 x cp=2
x ep=2 resumes at ep=1."""

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


def test_gpt_moe_at_dp1_cp2_ep2_trains_like_one_process_and_resumes_at_ep1(ray_session, tmp_path):
    """EP drawn from the CP ranks (Note [expert parallelism]): at dp=1 the two CP ranks of the
    replica split the experts and exchange their shards' tokens; the checkpoint (CP rank 1 writes
    its expert pieces and their momentum) resumes at cp=1, ep=1 equal to the uninterrupted run."""
    cfg = GPTConfig(vocab_size=16, seq_len=8, d_model=8, n_heads=2, n_layers=2, n_experts=4, top_k=2, expert_hidden=6)
    g = torch.Generator().manual_seed(7)
    data = [(torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g)) for _ in range(3)]
    options = dict(loss_fn=lm_loss, optimizer=sgd, moe_aux_loss_coef=AUX, device="cpu")
    with mpmd.Pipeline(gpt_stages(cfg, 1), schedule="1f1b", num_microbatches=2, num_actors=1, dp=1, ep=2, cp=2,
                       **options) as pipe:
        assert pipe.engine.grid.ep_groups() == [[0, 1]]
        losses = [pipe.step(x, y) for x, y in data[:2]]
        state, metrics = pipe.state_dict(), pipe.moe_metrics
        path = pipe.save(str(tmp_path / "ckpt"))
    with mpmd.Pipeline.load(path, stages=gpt_stages(cfg, 1), ep=1, cp=1, **options) as pipe:
        losses.append(pipe.step(*data[2]))
        resumed = pipe.state_dict()
    ref_losses, ref_state, _, _ = _reference(gpt_stages(cfg, 1), data[:2], 2, aux=AUX)
    ref3_losses, ref3_state, _, _ = _reference(gpt_stages(cfg, 1), data, 2, aux=AUX)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref3_losses[:3]), rtol=1e-5, atol=1e-6)
    for got, want in ((state, ref_state), (resumed, ref3_state)):
        assert list(got) == list(want)
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{k}: {msg}")
    loads = {k: v for k, v in metrics.items() if k.endswith(".load")}
    assert loads and all(sum(v) == 4 * 8 * 2 for v in loads.values())  # every token x top_k, once over both CP ranks
