"""Mixture-of-experts layers that follow Hugging Face's protocol (Note [MoE protocol] in
actors/experts.py), for the models of this package (``mpmd.models.gpt``) and for users'
own models: a router, fused experts and the block that joins them with shared experts."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from torch.nn import functional as F

from actors.experts import experts_forward

__all__ = ["Router", "Experts", "MoE"]

_ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "relu": F.relu}


class Router(nn.Module):
    """Top-k routing over ``num_experts``: ``softmax`` scores (Qwen3-MoE, Mixtral) or ``sigmoid``
    scores (DeepSeek-V3: chosen by score plus ``e_score_correction_bias``, the bias that the
    auxiliary-loss-free update moves, and limited to the best ``topk_groups`` of ``num_groups``
    expert groups); weights normalised over the k chosen when ``norm_topk``, times ``route_scale``.
    Scores are computed in float32 whatever the autocast dtype."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 norm_topk: bool = True, num_groups: int = 1, topk_groups: int = 1, route_scale: float = 1.0,
                 bias: Optional[bool] = None) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..num_experts ({num_experts}), got {top_k}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        if num_experts % num_groups or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts}) and topk_groups "
                             f"({topk_groups}) be in 1..num_groups")
        if num_groups > 1 and top_k > topk_groups * (num_experts // num_groups):
            raise ValueError(f"top_k ({top_k}) exceeds the experts of the {topk_groups} groups a token may use")
        self.top_k, self.score_func, self.norm_topk = top_k, score_func, norm_topk
        self.num_groups, self.topk_groups, self.route_scale = num_groups, topk_groups, route_scale
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        nn.init.normal_(self.weight, std=1 / math.sqrt(hidden))
        if bias if bias is not None else score_func == "sigmoid":
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if self.score_func == "softmax" else logits.sigmoid()
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.num_groups > 1:
            per_group = choice.view(-1, self.num_groups, choice.shape[-1] // self.num_groups)
            best = per_group.topk(min(2, per_group.shape[-1]), dim=-1)[0].sum(-1).topk(self.topk_groups, dim=-1)[1]
            keep = torch.zeros_like(per_group[..., 0]).scatter_(1, best, 1.0).bool()
            choice = per_group.masked_fill(~keep[..., None], float("-inf")).reshape_as(choice)
        indices = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, indices)
        if self.norm_topk:
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if self.score_func == "sigmoid" else 0.0))
        return logits, (weights * self.route_scale).to(x.dtype), indices


class Experts(nn.Module):
    """``num_experts`` gated MLPs ``down(act(gate(x)) * up(x))`` in two fused 3-D parameters, in
    Hugging Face's layout: ``gate_up_proj [E, 2I, H]`` (gate rows, then up rows), ``down_proj [E, H, I]``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, act: str = "silu") -> None:
        super().__init__()
        if act not in _ACTIVATIONS:
            raise ValueError(f"act must be one of {sorted(_ACTIVATIONS)}, got {act!r}")
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        nn.init.normal_(self.gate_up_proj, std=1 / math.sqrt(hidden))
        nn.init.normal_(self.down_proj, std=1 / math.sqrt(intermediate))
        self.act_fn = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return experts_forward(self.gate_up_proj, self.down_proj, self.act_fn, x, indices, weights)


class _SharedExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.act_fn = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A mixture-of-experts MLP: each token through its router's top-k routed experts, weighted,
    plus the shared experts (an MLP of ``shared_intermediate``; none when 0) every token takes.
    Takes and returns ``[..., hidden]``.  Router options as ``Router``."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, *,
                 shared_intermediate: int = 0, act: str = "silu", **router) -> None:
        super().__init__()
        self.gate = Router(hidden, num_experts, top_k, **router)
        self.experts = Experts(num_experts, hidden, intermediate, act)
        self.shared_experts = _SharedExperts(hidden, shared_intermediate, act) if shared_intermediate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        _, weights, indices = self.gate(flat)
        out = self.experts(flat, indices, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        return out.reshape(x.shape)
