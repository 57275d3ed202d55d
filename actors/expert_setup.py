"""A stage's MoE blocks as the runtime sets them up (Note [expert parallelism] in actors/grid.py):
the checks of ``ep`` against each block (on the controller before any actor starts, and again
on the actor for stages built there by a factory), the experts sharded over the EP group, the
routers watched (``attach``: token counts, the auxiliary loss, the bias update), and after each
optimizer step the blocks' ``finish_step`` with the loads summed over the replicas."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

import torch

from .experts import attach, find_moe_blocks, finish_step, is_expert_param, shard_experts
from .update import Recipe

__all__ = ["num_experts_of", "top_k_of", "check_experts", "ExpertStages"]


def num_experts_of(block: torch.nn.Module) -> int:
    """The number of routed experts of a MoE block (its experts', else its router's)."""
    n = getattr(block.experts, "num_experts", None)
    if n is None:
        n = block.gate.weight.shape[0]
    return int(n)


def top_k_of(block: torch.nn.Module) -> Optional[int]:
    """The experts each token goes to, where the router says (``top_k``), else None."""
    k = getattr(block.gate, "top_k", None)
    return int(k) if isinstance(k, int) else None


def check_experts(modules: Iterable[tuple[int, torch.nn.Module]], ep: int, *, whole: bool) -> None:
    """``ep`` fits every MoE block of ``modules`` (``(stage, module)`` pairs), or a ``ValueError``
    saying what to change.  ``whole``: the modules are all the pipeline's stages, so ``ep > 1``
    without any MoE block is refused too."""
    found = 0
    for s, module in modules:
        for name, block in find_moe_blocks(module):
            found += 1
            e, k = num_experts_of(block), top_k_of(block)
            if k is not None and k > e:
                raise ValueError(f"stage {s}'s MoE block {name!r} routes each token to top_k={k} experts but has "
                                 f"only {e}; use a top_k of at most {e}")
            if e % ep:
                fits = [d for d in range(1, e + 1) if e % d == 0]
                raise ValueError(f"ep={ep} does not divide the {e} experts of stage {s}'s MoE block {name!r}: each EP "
                                 f"rank holds an equal share; use an ep among {fits} (that also divides dp x cp)")
    if whole and ep > 1 and not found:
        raise ValueError(f"ep={ep} splits MoE blocks' experts over a stage's dp x cp actors, but no stage has a MoE block (a "
                         "module with a router `gate` and `experts`, e.g. mpmd.moe.MoE or a Hugging Face MoE "
                         "layer); use ep=1 for a dense model")


class ExpertStages:
    """The MoE side of one actor's stages: which parameters are experts, and the stages whose
    blocks are watched (``finish_step`` after each optimizer step)."""

    def __init__(self, modules: dict[int, torch.nn.Module], *, ep: int, ep_rank: int, group, recipe: Recipe,
                 dp: int, zero: int, edp_size: int) -> None:
        if ep > 1:
            check_experts(modules.items(), ep, whole=False)  # a factory's stage is first seen here
            for module in modules.values():
                shard_experts(module, group, ep_rank, ep)
        self.watched: list[int] = []  # stages with MoE blocks under ``attach``, in stage order
        if ep > 1 or recipe.moe_hooks:
            for s in sorted(modules):
                if find_moe_blocks(modules[s]):
                    attach(modules[s], aux_loss_coef=recipe.moe_aux_loss_coef,
                           bias_update_rate=recipe.moe_bias_update_rate)
                    self.watched.append(s)
        self.params = {s: [p for p in m.parameters() if is_expert_param(p)] for s, m in modules.items()}
        self.ids = frozenset(id(p) for ps in self.params.values() for p in ps)
        # Note [agreed update]: an expert element's gradient is on ``edp_size`` members, a dense one
        # on ``dp`` (the dp x cp members; the divisor the update applies; 1 under ZeRO-1, whose owners count once)
        self.norm_weight = (1 if zero else dp) / edp_size
        self.dp = dp

    def counted(self, counted: list) -> tuple[list, float]:
        """``update``'s ``experts``: the expert parameters among ``counted`` and their weight."""
        return [p for p in counted if id(p) in self.ids], self.norm_weight

    def finish_step(self, modules: dict[int, torch.nn.Module], dp_sum: Callable[[torch.Tensor], torch.Tensor],
                    report: bool, skipped: bool = False) -> Optional[dict]:
        """After the optimizer step: each watched stage's ``finish_step``, in stage order on every
        replica alike (the loads summed over its dp group); the metrics when ``report``, each
        name prefixed with its stage (``"stage3.layers.0.mlp.load"``).  A ``skipped`` step (every
        actor agreed, Note [agreed update]) moves no bias: its loads count as none (``finish_step`` moves
        no bias on zero loads) and are reset."""
        total = _no_load if skipped else dp_sum
        metrics: dict = {}
        for s in self.watched:
            metrics.update({f"stage{s}.{k}": v for k, v in finish_step(modules[s], sum_=total).items()})
        aux = sorted(k for k in metrics if k.endswith(".aux"))  # each replica's mean: the mean over all
        if aux and self.dp > 1:
            means = dp_sum(torch.tensor([metrics[k] for k in aux], dtype=torch.float64)) / self.dp
            metrics.update(zip(aux, means.tolist()))
        return metrics if report and self.watched else None


def _no_load(loads: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(loads)
