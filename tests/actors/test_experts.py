"""Expert parallelism inside two gloo processes against the experts whole in one, and the MoE
hooks (auxiliary loss, counts, bias update) against their definitions (Note [expert parallelism])."""

from __future__ import annotations

import pytest
import torch

import mpmd.moe as moe
from actors.experts import ExpertParallelExperts, expert_ranges, is_expert_param

from tests.gloo import run_ranks

HIDDEN, INTER, EXPERTS, TOP_K = 12, 6, 8, 2


def _block(seed: int = 0, **router) -> moe.MoE:
    torch.manual_seed(seed)
    return moe.MoE(HIDDEN, INTER, EXPERTS, TOP_K, shared_intermediate=5, **router)


def _inputs(replica: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + replica)
    return torch.randn(3, 7 + 2 * replica, HIDDEN, generator=g)  # replicas route unequal token counts


def _worker(rank: int, group, ep: int) -> dict:
    block = _block()
    moe.shard_experts(block, group, rank, ep)
    x = _inputs(rank).requires_grad_(True)
    y = block(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return {"y": y.detach(), "x_grad": x.grad, "ranges": expert_ranges(block),
            "grads": {n: p.grad.clone() for n, p in block.named_parameters()},
            "expert_flags": {n: is_expert_param(p) for n, p in block.named_parameters()}}


def test_two_ep_ranks_compute_what_the_whole_experts_compute():
    size = 2
    got = run_ranks(_worker, size, size, threads=1)
    reference = _block()
    expert_grads = {"experts.gate_up_proj": torch.zeros_like(reference.experts.gate_up_proj),
                    "experts.down_proj": torch.zeros_like(reference.experts.down_proj)}
    for rank in range(size):
        reference.zero_grad()
        x = _inputs(rank).requires_grad_(True)
        y = reference(x)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        torch.testing.assert_close(got[rank]["y"], y.detach(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got[rank]["x_grad"], x.grad, rtol=1e-5, atol=1e-6)
        for name, p in reference.named_parameters():
            if name in expert_grads:
                expert_grads[name] += p.grad
            else:  # dense parts: each replica's own gradient
                torch.testing.assert_close(got[rank]["grads"][name], p.grad, rtol=1e-5, atol=1e-6)
    half = EXPERTS // size
    for rank in range(size):
        assert got[rank]["ranges"] == {n: (rank * half, EXPERTS) for n in expert_grads}
        assert got[rank]["expert_flags"] == {n: n in expert_grads for n in got[rank]["grads"]}
        for name, whole in expert_grads.items():  # an expert's gradient sums both replicas' tokens
            torch.testing.assert_close(got[rank]["grads"][name], whole[rank * half:(rank + 1) * half],
                                       rtol=1e-5, atol=1e-6)


def test_ep_that_does_not_divide_the_experts_is_refused():
    with pytest.raises(ValueError, match="ep=3 does not divide the 8 experts"):
        ExpertParallelExperts(_block().experts, None, 0, 3)


def test_aux_loss_trains_as_if_added_to_the_loss():
    scale = 0.25
    hooked, plain = _block(score_func="sigmoid"), _block(score_func="sigmoid")
    moe.attach(hooked, aux_loss_coef=0.1)
    x = _inputs(0)
    with moe.loss_scale(scale):
        hooked(x).sum().mul(scale).backward()
    logits, _, indices = plain.gate(x.reshape(-1, HIDDEN))
    aux = 0.1 * moe.load_balancing_loss(logits, indices, "sigmoid")
    ((plain(x).sum() + aux) * scale).backward()
    for (name, a), b in zip(hooked.named_parameters(), plain.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7, msg=name)
    assert moe.finish_step(hooked)["moe.aux"] == pytest.approx(aux.item())


def test_bias_update_moves_against_the_load_summed_over_replicas():
    block = _block(score_func="sigmoid")
    moe.attach(block, bias_update_rate=0.01)
    block(_inputs(0))
    with torch.no_grad():  # not counted: no graph (predict)
        counts = torch.bincount(block.gate(_inputs(0).reshape(-1, HIDDEN))[2].reshape(-1), minlength=EXPERTS).double()
    metrics = moe.finish_step(block, sum_=lambda t: t * 2)  # as if two replicas saw the same
    load = counts * 2
    assert metrics["moe.load"] == load.tolist()
    torch.testing.assert_close(block.gate.e_score_correction_bias,
                               (0.01 * torch.sign(load.mean() - load)).float())
    assert moe.finish_step(block)["moe.load"] == [0.0] * EXPERTS  # counts restart each step


def test_top_k_above_the_experts_is_refused():
    with pytest.raises(ValueError, match="top_k must be in 1..num_experts"):
        moe.Router(HIDDEN, 4, 5)


def _split_worker(rank: int, group) -> dict:
    from actors.split_backward import plan_weight_seeds

    torch.manual_seed(0)
    experts = ExpertParallelExperts(moe.Experts(4, 8, 6), group, 0, 1)  # 4 local experts
    x = torch.randn(5, 8, requires_grad=True)
    out = {}
    for name, routing in (("one expert hit", [[0]] * 5), ("two experts hit", [[0], [1], [0], [1], [0]])):
        y = experts(x, torch.tensor(routing), torch.ones(5, 1))
        out[name] = plan_weight_seeds([y], {id(p): p for p in experts.parameters()}) is not None
    return out


def test_whether_w_exchanges_again_does_not_depend_on_the_routing():
    """Note [routing-free graph]: the split backward's choice (exact, or W through the exchanges
    again) must be the same on every EP member whatever its tokens chose."""
    got = run_ranks(_split_worker, 1)[0]
    assert got == {"one expert hit": True, "two experts hit": True}  # exact: W exchanges nothing
