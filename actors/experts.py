"""Mixture-of-experts on the actors: expert parallelism (a stage's experts split over the replicas
of its pipeline rank; tokens travel to their experts' actors and back by all-to-all), and what
every MoE block gets in training: the per-microbatch auxiliary load-balancing loss, per-expert
token counts and DeepSeek's auxiliary-loss-free bias update.

Note [MoE protocol]
~~~~~~~~~~~~~~~~~~~
A *MoE block* is any module with a router ``gate`` and an ``experts`` module, as Hugging Face's
families build them (Qwen3-MoE, DeepSeek-V3, Mixtral) and ``mpmd.moe.MoE`` does:
``gate(x[T, H]) -> (logits[T, E], weights[T, k], indices[T, k])`` and
``experts(x[T, H], indices, weights) -> [T, H]`` with the experts fused in two 3-D parameters,
``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]`` (dimension 0 is the expert).  The
runtime needs nothing else of a model: it finds the blocks (``find_moe_blocks``), hooks their
routers (``attach``) and, at ``ep > 1``, replaces their experts (``shard_experts``).

Note [expert parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~
With ``ep = P`` the replicas of a pipeline rank form groups of ``P`` consecutive replicas (Note
[device grid] in actors/grid.py); EP rank ``p`` of a group holds experts ``[p E/P, (p+1) E/P)``
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

Autograd runs the reverse exchanges in the backward: the gradient of step 4 travels as step 2's
forward did and vice versa, so an expert's weight gradient sums the tokens of every replica of
its group.  It is dropless: every pair reaches its expert, whatever the load.  Every member of a
group runs the same program, so each block's exchanges come in the same order on every member
(what the order model checks before launch).  gloo with CUDA tensors (actors sharing a GPU, the
staged transport) exchanges through host copies.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from .exchange import EXCHANGES, AllToAll, ExchangeLog, exchange

__all__ = ["find_moe_blocks", "is_experts", "experts_forward", "ExpertParallelExperts", "shard_experts",
           "expert_ranges", "is_expert_param", "score_function", "load_balancing_loss", "loss_scale",
           "current_loss_scale", "attach", "MoEHooks", "finish_step", "ExchangeLog", "EXCHANGES"]

_LOSS_SCALE = contextvars.ContextVar("mpmd_moe_loss_scale", default=1.0)
_EXPERT_PARAMS: "weakref.WeakValueDictionary[int, torch.Tensor]" = weakref.WeakValueDictionary()  # by id: tensors compare elementwise
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
        host = counts.device.type == "cuda" and dist.get_backend(self.group) == "gloo"
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
        outs = []
        for e, n in enumerate(by_source.sum(0).tolist()):
            if n:
                chunk, rows = rows[:n], rows[n:]
                gate, up = nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
                outs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
        done = torch.cat(outs) if outs else arrived.new_zeros((0,) + tuple(arrived.shape[1:]))
        back = done[torch.argsort(group_order)]  # in arrival order again
        returned = AllToAll.apply(back, send, recv, self.group, "combine")  # in ``order``
        contrib = returned * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, contrib.to(x.dtype))


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


def score_function(router: nn.Module) -> str:
    """"sigmoid" (DeepSeek-V3: a bias-corrected sigmoid router) or "softmax"."""
    own = getattr(router, "score_func", None)
    if own is not None:
        return own
    return "sigmoid" if hasattr(router, "e_score_correction_bias") else "softmax"


def load_balancing_loss(logits: torch.Tensor, indices: torch.Tensor, score: str) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over one microbatch's tokens: ``f_e`` the fraction of (token, slot)
    pairs routed to expert ``e``, ``P_e`` its mean routing probability (softmax, or the sigmoid
    scores normalised per token)."""
    num = logits.shape[-1]
    logits = logits.reshape(-1, num).float()
    probs = logits.softmax(-1) if score == "softmax" else _normalised(logits.sigmoid())
    fraction = torch.bincount(indices.reshape(-1), minlength=num).to(probs.dtype) / indices.numel()
    return num * (fraction * probs.mean(0)).sum()


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
        self.counts = torch.zeros(self.num_experts, dtype=torch.float64)
        self.routing: list[torch.Tensor] = []
        self.aux_sum, self.aux_count = 0.0, 0
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
            state.counts += torch.bincount(indices.detach().reshape(-1).cpu(), minlength=state.num_experts).double()
            if self.aux_loss_coef:
                aux = self.aux_loss_coef * load_balancing_loss(logits, indices, score_function(router))
                state.aux_sum += float(aux.detach())
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
        loads = torch.cat([s.counts for s in self.blocks])
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
                metrics[f"{name}.aux"] = state.aux_sum / state.aux_count
            if isinstance(bias, torch.Tensor):
                metrics[f"{name}.bias"] = bias.detach().float().cpu().tolist()
            state.counts.zero_()
            state.aux_sum, state.aux_count = 0.0, 0
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
