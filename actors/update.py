"""The end of a training step on one actor: the optimizer update, decided across actors.

Note [agreed update]: every actor takes the same decision from the same global numbers,
so the stages never disagree about a step:
1. fp16: gradients are unscaled (the loss was multiplied by the loss scale);
2. one all-reduce over every actor gives whether any loss or gradient is non-finite and,
   with clipping, the global gradient norm (each actor adds its stages' partial norms;
   a parameter tied across stages is counted at its first stage only; the data-parallel
   replicas hold equal gradients by now, so the sum is divided by ``dp``; under ZeRO-1 each
   replica adds only the gradients it owns, Note [ZeRO-1 sharding] in actors/zero.py; an expert
   parameter's gradient lives on the ``dp / ep`` replicas of its EDP group, so its part is
   weighted to count each expert element once, Note [expert parallelism] in actors/grid.py).
   The norm is accumulated in float64 from each gradient on (torch's clip_grad_norm_ works
   in the gradients' dtype: in float32 the norm's last bit moves the clip coefficient, and
   AdamW turns that into a visible step on an element whose gradient is near zero; a
   reference clips with ``torch.nn.utils.get_total_norm`` of float64 gradients);
3. a non-finite step is applied nowhere (``on_nan`` then raises or skips on the
   controller; fp16 halves its loss scale instead), else every gradient is scaled by the
   same clipping factor, the optimizers step and the LR schedulers step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .comm import Communicator
from .tensor_parallel import align_grads, counted_here, local, step

__all__ = ["Recipe", "LossScale", "Update", "update", "autocast_dtype", "counted_params"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_dtype(precision: str) -> Optional[torch.dtype]:
    """The dtype stages compute (and hand on their outputs) in: None for fp32."""
    return _DTYPES.get(precision)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """How an actor updates its stages (``setup``)."""

    clip_grad_norm: Optional[float] = None
    clip_norm_type: float = 2.0
    precision: str = "fp32"  # "fp32" | "bf16" | "fp16"
    recompute: tuple = ()  # stages whose forward is recomputed in the backward
    # the last stage's loss and backward under torch's loss_parallel() (logits sharded over the
    # vocabulary: Note [vocabulary-parallel loss] in mpmd/tensor_parallel/builtin.py)
    loss_parallel: bool = False
    # MoE blocks (actors/experts.py ``attach``): the load-balancing loss's weight and the
    # routers' bias step per optimizer step (0: off)
    moe_aux_loss_coef: float = 0.0
    moe_bias_update_rate: float = 0.0

    @property
    def moe_hooks(self) -> bool:
        """Whether the MoE blocks are watched (``attach``) even at ep=1."""
        return self.moe_aux_loss_coef > 0 or self.moe_bias_update_rate > 0


@dataclasses.dataclass
class LossScale:
    """fp16's dynamic loss scale, the same on every actor (``torch.amp.GradScaler``'s rule)."""

    scale: float = 2.0 ** 16
    growth_tracker: int = 0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
        else:
            self.growth_tracker += 1
            if self.growth_tracker == self.growth_interval:
                self.scale *= self.growth_factor
                self.growth_tracker = 0


@dataclasses.dataclass(frozen=True)
class Update:
    skipped: bool
    grad_norm: Optional[float]
    lr: Optional[float]


def counted_params(modules: dict, ties: tuple, zero: Optional[dict], tp_rank: int) -> list:
    """The parameters whose gradients this actor adds to the global norm (Note [agreed update]):
    a tied parameter once, its copy in the tie's first stage; under ZeRO-1 (``zero``: stage ->
    ZeroStage) the ones this replica owns; under TP each element once (``counted_here``)."""
    copies = {id(p) for tie in ties for s, names in tie.names.items() if s != tie.owner
              for n, p in modules[s].named_parameters() if n in names}
    return [p for s in sorted(modules) for p in modules[s].parameters() if id(p) not in copies
            and (zero is None or zero[s].owns(p)) and counted_here(p, tp_rank)]


def update(optimizers: dict, schedulers: dict, counted: list, comm: Communicator, recipe: Recipe,
           losses_finite: bool, dp: int, scale: Optional[LossScale],
           gather: Optional[Callable[[], None]] = None, experts: tuple[list, float] = ((), 1.0)) -> Update:
    """Note [agreed update]; ``counted``: the parameters whose gradients enter the norm here;
    ``dp``: how many replicas count each of them (1 under ZeRO-1, where each replica counts the
    parameters it owns); ``gather()``: after the optimizers stepped (ZeRO-1's all-gather);
    ``experts``: the expert parameters among ``counted`` and how much their part weighs (``dp``
    over the replicas holding each of them)."""
    params = [p for opt in optimizers.values() for group in opt.param_groups for p in group["params"]]
    align_grads(params + counted)  # under TP: each gradient laid out as its parameter (Note [tensor parallelism])
    grads = [local(p.grad) for p in params if p.grad is not None]  # a DTensor's own part (Note [tensor parallelism])
    flag = torch.tensor(0.0 if losses_finite else 1.0, dtype=torch.float64, device=comm.device)
    if scale is not None and grads:  # fused kernels (one launch per dtype, not per parameter); exact on CPU
        flag = torch.maximum(flag, unscale_(grads, scale.scale).to(torch.float64))
    p = recipe.clip_norm_type
    partial = torch.zeros((), dtype=torch.float64, device=comm.device)
    clipping = recipe.clip_grad_norm is not None
    if clipping and (cg := [local(q.grad) for q in counted if q.grad is not None]):
        norms = torch.stack(torch._foreach_norm(cg, p, dtype=torch.float64))  # each accumulated in float64
        if not math.isinf(p) and experts[0]:  # Note [agreed update]: each expert element counted once
            ids = {id(q) for q in experts[0]}
            weights = [experts[1] if id(q) in ids else 1.0 for q in counted if q.grad is not None]
            norms = norms.pow(p) * torch.tensor(weights, dtype=torch.float64, device=norms.device)
            partial = norms.sum()
        else:
            partial = norms.max() if math.isinf(p) else norms.pow(p).sum()
    # Note [agreed update]: one all-reduce over every actor, the norm and the flag together.
    both = torch.stack([partial, flag]).to(comm.wire)  # gloo (Note [staged transport]) reduces host memory
    dist.all_reduce(both, op=dist.ReduceOp.MAX if math.isinf(p) else dist.ReduceOp.SUM)
    total, nonfinite = both.tolist()
    nonfinite = nonfinite > 0
    norm = None
    if clipping:
        norm = total if math.isinf(p) else (total / dp) ** (1.0 / p)
        nonfinite = nonfinite or not math.isfinite(norm)
    lr = next((g["lr"] for opt in optimizers.values() for g in opt.param_groups), None)
    if scale is not None:
        scale.update(not nonfinite)
    if not nonfinite:
        if norm is not None:
            coef = min(1.0, recipe.clip_grad_norm / (norm + 1e-6))  # as torch.nn.utils.clip_grad_norm_
            scale_(grads, coef)
        for opt in optimizers.values():
            step(opt)  # mixed DTensor and plain parameters under TP (Note [tensor parallelism])
        if gather is not None:
            gather()
        for sched in schedulers.values():
            sched.step()
    for opt in optimizers.values():
        opt.zero_grad(set_to_none=True)
    return Update(skipped=nonfinite, grad_norm=norm, lr=float(lr) if lr is not None else None)


def unscale_(grads: list, scale: float) -> torch.Tensor:
    """Divide ``grads`` by the loss scale in place (a power of two: exact); 1.0 (a tensor on their
    device) when one of them is not finite.  One fused kernel per dtype
    (``torch._amp_foreach_non_finite_check_and_unscale_``, GradScaler's)."""
    found = torch.zeros(1, dtype=torch.float32, device=grads[0].device)
    inv = torch.full((1,), 1.0 / scale, dtype=torch.float32, device=grads[0].device)
    by_dtype: dict = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for group in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(group, found, inv)
    return found[0]


def scale_(grads: list, coef: float) -> None:
    """``g.mul_(coef)`` for every gradient: one fused kernel for the float32 ones (the same bits);
    the others one by one (torch's fused kernel rounds a bfloat16 product differently)."""
    fp32 = [g for g in grads if g.dtype == torch.float32]
    if fp32:
        torch._foreach_mul_(fp32, coef)
    for g in grads:
        if g.dtype != torch.float32:
            g.mul_(coef)
