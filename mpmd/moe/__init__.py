"""Mixtures of experts: layers (``Router``, ``Experts``, ``MoE``) and what training them needs
in one process as on the actors (auxiliary loss, bias update, expert parallelism).  docs/moe.md."""

from actors.experts import (attach, expert_ranges, find_moe_blocks, finish_step, is_expert_param,
                            load_balancing_loss, loss_scale, shard_experts)

from .layers import MoE, Experts, Router

__all__ = ["MoE", "Experts", "Router", "attach", "finish_step", "loss_scale", "shard_experts", "expert_ranges",
           "find_moe_blocks", "is_expert_param", "load_balancing_loss"]
