"""The optimizer and learning-rate schedule of ``mpmd train`` as picklable factories (the
actors call them on each stage's parameters), and the pipeline options from the config."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from .config import OptimConfig, ParallelConfig

__all__ = ["AdamWFactory", "LRSchedule", "SchedulerFactory", "pipeline_options"]


@dataclasses.dataclass(frozen=True)
class AdamWFactory:
    """AdamW; weight decay on matrices only (embeddings and projections), not on norms."""

    cfg: OptimConfig

    def __call__(self, params) -> torch.optim.Optimizer:
        params = list(params)
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": self.cfg.weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        return torch.optim.AdamW(groups, lr=self.cfg.lr, betas=(self.cfg.beta1, self.cfg.beta2), eps=self.cfg.eps)


@dataclasses.dataclass(frozen=True)
class LRSchedule:
    """The LR multiplier at a step: linear warm-up over ``warmup_steps``, then ``decay`` to
    ``min_lr_ratio`` at ``steps`` (cosine, linear or constant).  Plain fields only: LambdaLR
    keeps a callable object's ``__dict__`` in its state, which checkpoints load with
    ``torch.load(weights_only=True)``."""

    steps: int
    warmup_steps: int
    decay: str
    min_lr_ratio: float

    @classmethod
    def of(cls, cfg: OptimConfig) -> "LRSchedule":
        return cls(cfg.steps, cfg.warmup_steps, cfg.decay, cfg.min_lr_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant" or self.steps <= self.warmup_steps:
            return 1.0
        frac = min(1.0, (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * frac)) if self.decay == "cosine" else 1.0 - frac
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * shape


@dataclasses.dataclass(frozen=True)
class SchedulerFactory:
    cfg: OptimConfig

    def __call__(self, optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule.of(self.cfg))


def pipeline_options(p: ParallelConfig, o: OptimConfig, document_mask: bool = False) -> dict:
    """``mpmd.Pipeline``'s keyword options for the config (stages, loss and factories aside)."""
    opts = dict(schedule=p.schedule, num_microbatches=p.microbatches, num_actors=p.actors, dp=p.dp, zero=p.zero,
                tp=p.tp, tp_plan="auto" if p.tp > 1 else None, loss_parallel=p.tp > 1,
                device=p.device, precision=p.precision, recompute=p.recompute, seed=o.seed,
                clip_grad_norm=o.clip_grad_norm or None, optimizer=AdamWFactory(o), lr_scheduler=SchedulerFactory(o),
                step_timeout_s=p.step_timeout_s or None,  # 0: no limit (Note [train's step timeout])
                overlap=p.overlap)  # docs/overlap.md
    # Mixture of experts (docs/moe.md): given only where set, so a dense model's options stay as they were
    moe = dict(ep=p.ep > 1, moe_aux_loss_coef=o.moe_aux_loss_coef > 0, moe_bias_update_rate=o.moe_bias_update_rate > 0)
    opts.update({key: getattr(p if key == "ep" else o, key) for key, given in moe.items() if given})
    # Context parallelism and document masking (docs/context.md): likewise only where set
    if p.cp > 1:
        opts["cp"] = p.cp
    if document_mask:
        opts["document_mask"] = True
    if p.memory_limit_gb is not None:
        opts["memory_limit_bytes"] = int(p.memory_limit_gb * 2 ** 30)
    return opts
