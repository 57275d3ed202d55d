"""What a mixture of experts adds to the dry run's per-actor memory (Note [dry-run memory] in
dry_run.py; ``plan.py``'s ``_stage_memory`` calls these for a MoE family).

Note [MoE dry-run memory]
~~~~~~~~~~~~~~~~~~~~~~~~~
Parameters: a stage's routed experts are split over ``parallel.ep`` of its replicas (each
actor holds ``E / ep`` of every MoE layer's experts, docs/moe.md); everything else is whole on
every replica.  An actor holds 16 bytes per parameter as for a dense model (float32 weights,
gradients, AdamW's two moments), but ZeRO-1 splits only the dense parameters' moments over
``dp``: the experts' moments are already split over ``ep`` and stay whole on their actor, so
an expert parameter costs 16 bytes where a dense one costs ``8 + 8 / dp``.

Activations per token of a MoE layer, in bytes at 16-bit (``34 h`` for a dense layer, Note
[dry-run memory]): the attention and the norms as a dense layer's (``17 h``: Korthikanti et al.'s
``11 h + 4 h`` and the block's input), and for the ``k`` (token, expert) pairs the rows the
all-to-all delivered (``2 k h``: the dispatch buffer, grouped by expert, which the experts'
first matmul keeps), the experts' ``gate_up`` output and ``act(gate) * up`` (``6 k I``), and
the rows the reverse all-to-all returned (``2 k h``: the combine buffer, kept by the weighting),
plus a shared expert's ``6 I_shared``.  So the all-to-all buffers are the ``4 k h`` bytes a token
keeps, from its forward to its backward.  This is the balanced case: an actor's experts then
receive ``k`` rows per token of its own microbatch, as many as it sends; routing that sends an
actor more rows (up to ``ep`` times as many, everything to its experts) grows that part.  The
latent attention of DeepSeek-V3 is counted as a dense layer's attention (its latent keys and
values are smaller; its per-head queries wider)."""

from __future__ import annotations

from typing import Optional

from .flops import expert_params
from .models import LlamaSpec
from .moe_models import layer_is_moe

__all__ = ["routed_expert_params", "param_bytes", "activation_bytes_per_token", "seed_bytes_per_token"]


def routed_expert_params(spec: LlamaSpec, first: int, count: int) -> int:
    """The routed experts' parameters of decoder layers ``[first, first + count)`` (all the EP ranks')."""
    return sum(expert_params(spec, i) for i in range(first, first + count))


def param_bytes(params: int, experts: int, ep: int, dp: int, zero: int) -> float:
    """The ``param_bytes`` to give ``rank_memory`` (which charges each ``2 + 2 / (dp if zero else
    1)`` times over) so that it charges the dense parameters so and each actor's ``experts / ep``
    16 bytes each (Note [MoE dry-run memory])."""
    factor = 2.0 + 2.0 / (dp if zero else 1)
    return 4.0 * ((params - experts) + experts / ep * 4.0 / factor)


def activation_bytes_per_token(spec: LlamaSpec, first: int, count: int, dense: float) -> float:
    """Bytes at 16-bit per token of layers ``[first, first + count)``: ``dense`` (``34 h``) for a
    dense layer, Note [MoE dry-run memory] for a MoE layer."""
    m, h = spec.moe, spec.hidden_size
    out = 0.0
    for i in range(first, first + count):
        if layer_is_moe(m, i):
            k, inner = m.experts_per_token, m.moe_intermediate_size
            out += 17.0 * h + k * (4.0 * h + 6.0 * inner) + 6.0 * inner * m.shared_experts
        else:
            out += dense
    return out


def seed_bytes_per_token(spec: LlamaSpec, first: int, count: int, dense: Optional[float]) -> float:
    """Elements per token a split backward holds from I to W (the gradient at each linear's
    output) of layers ``[first, first + count)``: ``dense`` for a dense layer; a MoE layer's
    attention, and its experts' ``gate_up`` and ``down`` outputs for ``k`` pairs, its shared
    expert's and its router's logits."""
    m, h = spec.moe, spec.hidden_size
    kv = h * spec.num_kv_heads // spec.num_heads
    out = 0.0
    for i in range(first, first + count):
        if layer_is_moe(m, i):
            inner, shared = m.moe_intermediate_size, m.moe_intermediate_size * m.shared_experts
            out += (2 * h + 2 * kv + h + m.experts_per_token * (2 * inner + h) + (2 * shared + h if shared else 0)
                    + m.num_experts)
        else:
            out += dense
    return out
