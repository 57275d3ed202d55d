"""Mixture-of-experts on the actors: expert parallelism (a stage's experts split over the replicas
of its pipeline rank; tokens travel to their experts' actors and back by all-to-all).  What every
MoE block gets in training (auxiliary loss, token counts, the bias update) is in
actors/moe_hooks.py, imported from here too.

Note [expert parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~
With ``ep = P`` the replicas of a pipeline rank form groups of ``P`` consecutive replicas (with
``cp > 1``, of its ``dp x cp`` actors, numbered ``replica x cp + CP rank``: Note [expert
parallelism] in actors/grid.py); EP rank ``p`` of a group holds experts ``[p E/P, (p+1) E/P)``
under the same parameter names (so state-dict keys do not change) and everything else whole.
Each replica routes its own microbatch; the forward of a block then

1. counts the (token, slot) pairs per expert and exchanges the counts (an all-to-all of equal
   sizes: every rank learns how many rows it will receive from every other, per local expert);
2. sends each pair's hidden state to its expert's rank, sorted by expert
   (``all_to_all_single`` with split sizes: gloo's list-form ``all_to_all`` refuses unequal
   sizes, and split sizes are what NCCL runs too);
3. runs its local experts on what arrived, grouped by expert;
4. sends the results back (the reverse all-to-all) and adds ``weight * result`` per token in
   ascending expert order, as the single-process loop does.

Note [routing-free graph]: the zero-bubble schedules split a backward in two (Note [weight seeds]
in actors/split_backward.py), exactly when no parameter sits under two weight nodes, else ``W``
runs the backward again, through this block's exchanges.  Expert ``e``'s weights are slices
``gate_up_proj[e]`` of one parameter: computed expert by expert, the parameter sits under one
weight node per expert with rows, so the choice would follow the routing (one expert hit: exact;
two: not), two members of a group could disagree on whether ``W`` exchanges (a hang on NCCL),
and mostly ``W`` would run the whole backward again, exchanges included.  So the local experts
are ONE autograd node over both fused weights (``_LocalExperts``, every local expert with its
rows or none): the split is exact whatever the routing, ``W`` exchanges nothing, and only the
experts' own backward runs in both halves (``I`` needs its input gradient, ``W`` its weight
gradients; autograd cannot ask a node for one of them).

Autograd runs the reverse exchanges in the backward: the gradient of step 4 travels as step 2's
forward did and vice versa, so an expert's weight gradient sums the tokens of every replica of
its group.  It is dropless: every pair reaches its expert, whatever the load.  Every member of a
group runs the same program, so each block's exchanges come in the same order on every member
(what the order model checks before launch).  gloo with CUDA tensors (actors sharing a GPU, the
staged transport) exchanges through host copies.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from .exchange import EXCHANGES, AllToAll, ExchangeLog, by_host, exchange  # noqa: F401 - EXCHANGES, ExchangeLog re-exported
# the MoE protocol and the training hooks, here for one import path (Note [MoE protocol])
from .moe_hooks import (MoEHooks, attach, current_loss_scale, find_moe_blocks, finish_step, hooks_of,  # noqa: F401
                        is_experts, load_balancing_loss, loss_scale, score_function)

__all__ = ["find_moe_blocks", "is_experts", "experts_forward", "ExpertParallelExperts", "shard_experts",
           "expert_ranges", "is_expert_param", "score_function", "load_balancing_loss", "loss_scale",
           "current_loss_scale", "attach", "MoEHooks", "hooks_of", "finish_step", "ExchangeLog", "EXCHANGES"]

_EXPERT_PARAMS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # by id: tensors compare elementwise


def experts_forward(gate_up: torch.Tensor, down: torch.Tensor, act_fn: Callable, x: torch.Tensor,
                    indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The single-process experts: for each expert hit, in ascending order, its tokens through
    ``down(act(gate) * up)``, scaled by their routing weight and added into the output (the loop
    of Hugging Face's eager experts, operation for operation)."""
    out = torch.zeros_like(x)
    num = gate_up.shape[0]
    with torch.no_grad():
        mask = nn.functional.one_hot(indices, num_classes=num).permute(2, 1, 0)  # [E, k, T]
        hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
    for e in hit:
        e = e[0]
        slot, token = torch.where(mask[e])
        gate, up = nn.functional.linear(x[token], gate_up[e]).chunk(2, dim=-1)
        h = nn.functional.linear(act_fn(gate) * up, down[e])
        out.index_add_(0, token, (h * weights[token, slot, None]).to(out.dtype))
    return out


class ExpertParallelExperts(nn.Module):
    """One EP rank's share of a block's experts (Note [expert parallelism])."""

    def __init__(self, experts: nn.Module, group, ep_rank: int, ep_size: int) -> None:
        super().__init__()
        whole = experts.gate_up_proj.shape[0]
        extra = sorted(n for n, _ in experts.named_parameters(recurse=False) if n not in ("gate_up_proj", "down_proj"))
        if extra:
            raise ValueError(f"{type(experts).__name__} has parameters {extra} besides gate_up_proj and down_proj "
                             f"(expert biases); expert parallelism splits only those two: use ep=1 for this model")
        if whole % ep_size:
            raise ValueError(f"ep={ep_size} does not divide the {whole} experts of {type(experts).__name__}: "
                             f"choose an ep that divides {whole}")
        self.num_experts, self.ep_size, self.ep_rank, self.group = whole, ep_size, ep_rank, group
        self.local_experts = whole // ep_size
        self.first_expert = ep_rank * self.local_experts
        cut = slice(self.first_expert, self.first_expert + self.local_experts)
        self.gate_up_proj = nn.Parameter(experts.gate_up_proj.detach()[cut].clone(),
                                         requires_grad=experts.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(experts.down_proj.detach()[cut].clone(), requires_grad=experts.down_proj.requires_grad)
        self.act_fn = experts.act_fn
        _EXPERT_PARAMS[id(self.gate_up_proj)] = self.gate_up_proj
        _EXPERT_PARAMS[id(self.down_proj)] = self.down_proj

    def extra_repr(self) -> str:
        return (f"experts {self.first_expert}..{self.first_expert + self.local_experts - 1} of {self.num_experts} "
                f"(ep rank {self.ep_rank} of {self.ep_size})")

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        k = indices.shape[1]
        flat = indices.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert, tokens ascending within one
        token = order // k
        counts = torch.bincount(flat, minlength=self.num_experts)  # per expert, in the order sent
        host = by_host(counts, self.group)
        counts_out = counts.cpu() if host else counts
        got = torch.empty_like(counts_out)  # equal splits: E/P counts to each rank
        exchange("counts", lambda: dist.all_to_all_single(got, counts_out, group=self.group, async_op=True))
        by_source = got.view(self.ep_size, self.local_experts)  # [source rank, local expert]
        send = counts_out.view(self.ep_size, self.local_experts).sum(1).tolist()
        recv = by_source.sum(1).tolist()
        arrived = AllToAll.apply(x[token], recv, send, self.group, "dispatch")  # by source, then local expert
        local = torch.repeat_interleave(torch.arange(self.local_experts).repeat(self.ep_size), by_source.reshape(-1).cpu())
        group_order = torch.argsort(local, stable=True).to(x.device)  # rows grouped by local expert
        rows = arrived[group_order]
        done = _LocalExperts.apply(rows, self.gate_up_proj, self.down_proj, tuple(by_source.sum(0).tolist()), self.act_fn)
        back = done[torch.argsort(group_order)]  # in arrival order again
        returned = AllToAll.apply(back, send, recv, self.group, "combine")  # in ``order``
        contrib = returned * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, contrib.to(x.dtype))


class _LocalExperts(torch.autograd.Function):
    """An EP rank's experts on the rows that arrived, grouped by expert (``sizes`` rows each), as
    ONE autograd node over both fused weights (Note [routing-free graph])."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, sizes: tuple,
                act_fn: Callable) -> torch.Tensor:
        pre, outs = [], []
        for e, chunk in enumerate(rows.split(sizes)):
            gate_and_up = nn.functional.linear(chunk, gate_up[e])
            gate, up = gate_and_up.chunk(2, dim=-1)
            pre.append(gate_and_up)
            outs.append(nn.functional.linear(act_fn(gate) * up, down[e]))
        ctx.sizes, ctx.act_fn = sizes, act_fn
        ctx.save_for_backward(rows, gate_up, down, torch.cat(pre))
        return torch.cat(outs)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, gate_up, down, pre = ctx.saved_tensors
        d_rows, d_gate_up, d_down = [], torch.zeros_like(gate_up), torch.zeros_like(down)
        for e, (x, gate_and_up, g) in enumerate(zip(rows.split(ctx.sizes), pre.split(ctx.sizes), grad.split(ctx.sizes))):
            with torch.enable_grad():  # the activation's own derivative, whatever act_fn is
                leaf = gate_and_up.detach().requires_grad_(True)
                gate, up = leaf.chunk(2, dim=-1)
                hidden = ctx.act_fn(gate) * up
            d_down[e] = g.t() @ hidden.detach()
            d_pre = torch.autograd.grad(hidden, leaf, g @ down[e])[0]
            d_gate_up[e] = d_pre.t() @ x
            d_rows.append(d_pre @ gate_up[e])
        return torch.cat(d_rows), d_gate_up, d_down, None, None


def shard_experts(module: nn.Module, group, ep_rank: int, ep_size: int) -> int:
    """Keep only EP rank ``ep_rank``'s experts in every MoE block of ``module`` (Note [expert
    parallelism]); the number of blocks.  ``group`` is the EP process group (only forward uses it)."""
    blocks = find_moe_blocks(module)
    for _, block in blocks:
        if not isinstance(block.experts, ExpertParallelExperts):
            block.experts = ExpertParallelExperts(block.experts, group, ep_rank, ep_size)
    return len(blocks)


def expert_ranges(module: nn.Module) -> dict[str, tuple[int, int]]:
    """Parameter name -> (its first expert in the whole tensor's dimension 0, the whole number of
    experts) for every parameter sharded over EP; every other parameter is whole."""
    out = {}
    for name, m in module.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for p in ("gate_up_proj", "down_proj"):
                out[f"{name}.{p}" if name else p] = (m.first_expert, m.num_experts)
    return out


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is an EP rank's share of experts (its gradient is reduced over the experts'
    data-parallel group, not over every replica: Note [expert parallelism])."""
    return _EXPERT_PARAMS.get(id(p)) is p

