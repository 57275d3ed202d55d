"""The training hooks of mixture-of-experts blocks, in one process as on the actors: the
per-microbatch auxiliary load-balancing loss, per-expert token counts and DeepSeek's
auxiliary-loss-free bias update; and the protocol by which the runtime knows a MoE block.

Note [MoE protocol]
~~~~~~~~~~~~~~~~~~~
A *MoE block* is any module with a router ``gate`` and an ``experts`` module, as Hugging Face's
families build them (Qwen3-MoE, DeepSeek-V3, Mixtral) and ``mpmd.moe.MoE`` does:
``gate(x[T, H]) -> (logits[T, E], weights[T, k], indices[T, k])`` and
``experts(x[T, H], indices, weights) -> [T, H]`` with the experts fused in two 3-D parameters,
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (dimension 0 is the expert).  The
runtime needs nothing else of a model: it finds the blocks (``find_moe_blocks``), hooks their
routers (``attach``) and, at ``ep > 1``, replaces their experts (``shard_experts`` in
actors/experts.py, Note [expert parallelism]).

Note [auxiliary loss under CP]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``cp > 1`` a router sees one zigzag shard of each sequence, all shards the same number of
tokens.  The whole sequence's loss ``E * sum_e f_e * P_e`` has ``f_e`` (routed fractions, no
gradient) and ``P_e`` (mean probabilities) over all tokens; ``P_e`` is the mean of the shards'
``P_e^c``.  So CP rank ``c`` takes ``E * sum_e f_e * P_e^c`` with ``f_e`` from the counts summed
over the CP group (one small all-reduce per MoE layer and forward, in the same order on every
CP rank, as the ring's exchanges are); the gradient average over the ``dp x cp`` actors (Note
[context-parallel runtime]) then gives the whole sequence's gradient.  A shard's own ``f_e``
would train a different loss.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .cp_runtime import active_shard
from .exchange import by_host

__all__ = ["is_experts", "find_moe_blocks", "score_function", "load_balancing_loss", "loss_scale",
           "current_loss_scale", "attach", "MoEHooks", "hooks_of", "finish_step"]

_LOSS_SCALE = contextvars.ContextVar("mpmd_moe_loss_scale", default=1.0)
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, MoEHooks]" = weakref.WeakKeyDictionary()


def is_experts(m: Any) -> bool:
    """A fused experts module (Note [MoE protocol])."""
    gate_up, down = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return (isinstance(m, nn.Module) and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
            and gate_up.dim() == 3 and down.dim() == 3)


def find_moe_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every MoE block under ``module`` (Note [MoE protocol]) with its qualified name, in module order."""
    return [(name, m) for name, m in module.named_modules()
            if isinstance(getattr(m, "gate", None), nn.Module) and is_experts(getattr(m, "experts", None))]


def score_function(router: nn.Module) -> str:
    """"sigmoid" (DeepSeek-V3: a bias-corrected sigmoid router) or "softmax"."""
    own = getattr(router, "score_func", None)
    if own is not None:
        return own
    return "sigmoid" if hasattr(router, "e_score_correction_bias") else "softmax"


def load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, score: str, shard: Any = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over one microbatch's tokens: ``f_e`` the fraction of (token, slot)
    pairs routed to expert ``e``, ``P_e`` its mean routing probability (softmax, or the sigmoid
    scores normalised per token).  Under context parallelism (``shard``, Note [auxiliary loss
    under CP]) ``f_e`` is the whole sequence's and ``P_e`` this shard's."""
    num = logits.shape[-1]
    logits = logits.reshape(-1, num).float()
    probs = logits.softmax(-1) if score == "softmax" else _normalised(logits.sigmoid())
    counts = torch.bincount(indices.reshape(-1), minlength=num).to(probs.dtype)
    pairs = indices.numel()
    if shard is not None and shard.group is not None and shard.cp > 1:
        counts, pairs = _summed_over(counts, shard.group), pairs * shard.cp
    return num * (counts / pairs * probs.mean(0)).sum()


def _summed_over(counts: torch.Tensor, group: Any) -> torch.Tensor:
    """``counts`` summed over the CP group (by a host copy where gloo needs one)."""
    staged = by_host(counts, group)
    total = counts.cpu() if staged else counts.clone()
    dist.all_reduce(total, group=group)
    return total.to(counts.device) if staged else total


def _normalised(scores: torch.Tensor) -> torch.Tensor:
    return scores / scores.sum(-1, keepdim=True)


@contextlib.contextmanager
def loss_scale(scale: float) -> Iterator[None]:
    """Forwards inside this train auxiliary losses with gradient ``scale``: the factor the
    microbatch's loss is scaled by (the runtime's ``1/num_microbatches``).  A single-process
    reference runs each microbatch's forward in ``loss_scale(1 / its microbatch count)``."""
    token = _LOSS_SCALE.set(float(scale))
    try:
        yield
    finally:
        _LOSS_SCALE.reset(token)


def current_loss_scale() -> float:
    return _LOSS_SCALE.get()


class _AddAuxiliary(torch.autograd.Function):
    """The identity on a block's output whose backward gives the auxiliary loss the gradient
    ``scale``: the aux loss trains as if it were added to the microbatch's loss, without
    travelling to the last stage."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape, ctx.aux_dtype, ctx.aux_device = aux.shape, aux.dtype, aux.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


class _BlockState:
    """What ``attach`` keeps for one MoE block between optimizer steps."""

    def __init__(self, name: str, block: nn.Module) -> None:
        self.name, self.block = name, block
        self.num_experts = block.gate.weight.shape[0] if hasattr(block.gate, "weight") else block.experts.num_experts
        # on the router's device, read once per step (finish_step): a host copy per forward would
        # synchronise a GPU once per MoE layer and microbatch
        self.counts: Optional[torch.Tensor] = None
        self.routing: list[torch.Tensor] = []
        self.aux_sum: Any = 0.0  # a tensor on the router's device once a forward added to it
        self.aux_count = 0
        self.pending: Optional[torch.Tensor] = None  # this forward's aux loss, until the block's output


class MoEHooks:
    """The hooks ``attach`` put on a module's MoE blocks, and what they counted this step."""

    def __init__(self, module: nn.Module, aux_loss_coef: float, bias_update_rate: float, record_routing: bool) -> None:
        self.aux_loss_coef, self.bias_update_rate, self.record_routing = aux_loss_coef, bias_update_rate, record_routing
        self.blocks = [_BlockState(name, block) for name, block in find_moe_blocks(module)]
        self.handles = []
        for state in self.blocks:
            self.handles.append(state.block.gate.register_forward_hook(self._router_hook(state)))
            self.handles.append(state.block.register_forward_hook(self._block_hook(state)))

    def _router_hook(self, state: _BlockState) -> Callable:
        def hook(router, args, output) -> None:
            logits, _, indices = output
            if self.record_routing:
                state.routing.append(indices.detach().cpu().clone())
            if not torch.is_grad_enabled():
                return  # predict, or the graph-free first forward of Note [recompute at I]
            counted = torch.bincount(indices.detach().reshape(-1), minlength=state.num_experts)
            state.counts = counted if state.counts is None else state.counts + counted
            if self.aux_loss_coef:
                aux = self.aux_loss_coef * load_balancing_loss(logits, indices, score_function(router), active_shard())
                state.aux_sum = state.aux_sum + aux.detach()
                state.aux_count += 1
                state.pending = aux
        return hook

    def _block_hook(self, state: _BlockState) -> Callable:
        def hook(block, args, output):
            if state.pending is None:
                return None
            aux, state.pending = state.pending, None
            if isinstance(output, tuple):
                return (_AddAuxiliary.apply(output[0], aux, current_loss_scale()),) + output[1:]
            return _AddAuxiliary.apply(output, aux, current_loss_scale())
        return hook

    def detach(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def finish_step(self, sum_: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict:
        """The step's metrics, and the bias update (Note [MoE protocol]); resets the counts."""
        if not self.blocks:
            return {}
        loads = torch.cat([torch.zeros(s.num_experts, dtype=torch.float64) if s.counts is None
                           else s.counts.double().cpu() for s in self.blocks])
        if sum_ is not None:
            loads = sum_(loads)
        metrics: dict = {}
        for state, load in zip(self.blocks, loads.split([s.num_experts for s in self.blocks])):
            bias = getattr(state.block.gate, "e_score_correction_bias", None)
            if self.bias_update_rate and isinstance(bias, torch.Tensor) and load.sum() > 0:
                step = self.bias_update_rate * torch.sign(load.mean() - load)
                with torch.no_grad():
                    bias.add_(step.to(bias.dtype).to(bias.device))
            name = state.name or "moe"
            metrics[f"{name}.load"] = load.tolist()
            if state.aux_count:
                metrics[f"{name}.aux"] = float(state.aux_sum) / state.aux_count
            if isinstance(bias, torch.Tensor):
                metrics[f"{name}.bias"] = bias.detach().float().cpu().tolist()
            state.counts, state.aux_sum, state.aux_count = None, 0.0, 0
        return metrics

    def routing(self) -> dict[str, list[torch.Tensor]]:
        """Every recorded forward's top-k indices, per block (``record_routing=True``)."""
        return {s.name: list(s.routing) for s in self.blocks}


def attach(module: nn.Module, *, aux_loss_coef: float = 0.0, bias_update_rate: float = 0.0,
           record_routing: bool = False) -> MoEHooks:
    """Hook every MoE block of ``module`` (Note [MoE protocol]): token counts per expert, the
    auxiliary loss ``aux_loss_coef * E * sum_e f_e P_e`` per block and microbatch (trained through
    ``loss_scale``), and DeepSeek's bias update at ``finish_step`` (``bias += rate * sign(mean
    load - load)`` on routers with ``e_score_correction_bias``).  Attaching again replaces the hooks."""
    if aux_loss_coef < 0 or bias_update_rate < 0:
        raise ValueError(f"aux_loss_coef and bias_update_rate must be >= 0, got {aux_loss_coef}, {bias_update_rate}")
    old = _ATTACHED.get(module)
    if old is not None:
        old.detach()
    hooks = _ATTACHED[module] = MoEHooks(module, aux_loss_coef, bias_update_rate, record_routing)
    return hooks


def hooks_of(module: nn.Module) -> Optional[MoEHooks]:
    return _ATTACHED.get(module)


def finish_step(module: nn.Module, sum_: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> dict:
    """Once per optimizer step, after it: ``attach``'s bias update and the step's metrics
    (``{"<block>.load": [tokens per expert], "<block>.aux": mean aux loss, "<block>.bias": [...]}``).
    ``sum_`` totals the loads over the replicas (the runtime's all-reduce over the stage's data-
    parallel group, so every replica updates its routers alike); None in one process."""
    hooks = _ATTACHED.get(module)
    return hooks.finish_step(sum_) if hooks is not None else {}
