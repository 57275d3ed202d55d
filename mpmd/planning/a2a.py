"""What a stage's expert all-to-alls cost per microbatch (``StageCost.a2a_f`` / ``a2a_b``),
before anything ran: the planner's estimate, replaced by the actors' measurement where a
trial profiled them.

Note [all-to-all estimate]
~~~~~~~~~~~~~~~~~~~~~~~~~~
At ``ep > 1`` each MoE layer exchanges a microbatch's tokens with the other ``ep - 1`` members
of its expert group (actors/experts.py): in a forward the counts, the dispatch (every token's
``top_k`` routed rows of ``hidden`` values to the member holding the expert) and the combine
(the rows back); in the input-gradient backward the combine's and the dispatch's reverse
(``W`` exchanges nothing).  Routing balanced, a member keeps ``1/ep`` of its rows, so a
dispatch or a combine moves ``tokens * top_k * hidden * element_bytes * (ep - 1) / ep`` bytes
off the rank.  The estimate charges each exchange a link's latency plus those bytes over its
bandwidth:

    a2a_f = layers * (3 * latency + 2 * moved / bandwidth)
    a2a_b = layers * (2 * latency + 2 * moved / bandwidth)

with ``tokens * hidden * element_bytes`` read off the stage's measured hidden state (its input;
the first stage's output), the link the *assumed* point-to-point one of the device kind
(``DEFAULT_LATENCY_S``, ``DEFAULT_BYTES_PER_S`` in measure.py: loopback gloo on CPU, NVLink
order of magnitude on CUDA), not a calibrated one.  The latency is the fixed part
(``a2a_f0``), the bytes scale with the rows.  An all-to-all is a collective: it also waits for
the group's slowest member, which the estimate leaves out and a trial measures.  Under
``schedule="auto"`` with trials (Note [calibrated auto] in replan.py) the profile's
all-to-alls (``calibrated_costs(..., exchanges=)``) replace the estimate: ``corrected_costs``
scales it by measured over estimated, as it does the computes.  The dry run
(``mpmd train --dry-run``) uses the same formula with the model's shapes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional, Sequence

import torch

from actors.expert_setup import top_k_of
from actors.moe_hooks import find_moe_blocks
from schedules import Costs

from .costs import StageCost

__all__ = ["exchange_seconds", "with_exchanges", "measured_exchanges", "moe_top_ks"]

FORWARD_EXCHANGES, BACKWARD_EXCHANGES = 3, 2  # counts, dispatch, combine; their reverse (no counts)


def exchange_seconds(hidden_bytes: float, top_ks: Sequence[int], ep: int, latency_s: float,
                     bytes_per_s: float) -> tuple[float, float, float, float]:
    """``(a2a_f, a2a_b, a2a_f0, a2a_b0)`` of a stage whose MoE layers route each token to
    ``top_ks[i]`` experts, for a microbatch whose hidden state is ``hidden_bytes`` (Note
    [all-to-all estimate]); zeros at ``ep == 1`` or without MoE layers."""
    if ep <= 1 or not top_ks:
        return 0.0, 0.0, 0.0, 0.0
    moved = sum(2.0 * hidden_bytes * k * (ep - 1) / ep for k in top_ks)  # dispatch + combine, each layer
    wire = moved / bytes_per_s if math.isfinite(bytes_per_s) else 0.0
    f0, b0 = len(top_ks) * FORWARD_EXCHANGES * latency_s, len(top_ks) * BACKWARD_EXCHANGES * latency_s
    return f0 + wire, b0 + wire, f0, b0


def moe_top_ks(module: torch.nn.Module) -> list[int]:
    """Per MoE block of ``module`` (Note [MoE protocol]), the experts a token goes to (1 where
    the router does not say)."""
    return [int(top_k_of(block) or getattr(block, "top_k", None) or 1) for _, block in find_moe_blocks(module)]


def with_exchanges(costs: Sequence[StageCost], modules: Sequence[torch.nn.Module], ep: int, latency_s: float,
                   bytes_per_s: float) -> list[StageCost]:
    """``costs`` with each MoE stage's estimated all-to-alls (Note [all-to-all estimate]); as
    they are at ``ep == 1`` or with one stage (no hidden state measured at a boundary)."""
    if ep <= 1 or len(costs) < 2:
        return list(costs)
    out = []
    for s, (cost, module) in enumerate(zip(costs, modules)):
        hidden = cost.in_bytes if s > 0 else cost.out_bytes
        f, b, f0, b0 = exchange_seconds(hidden, moe_top_ks(module), ep, latency_s, bytes_per_s)
        out.append(dataclasses.replace(cost, a2a_f=f, a2a_b=b, a2a_f0=f0, a2a_b0=b0) if f or b else cost)
    return out


def measured_exchanges(costs: Sequence[StageCost], measured: Costs, rows: Optional[float]) -> list[StageCost]:
    """``costs`` with each stage's all-to-alls set to what a trial at ``rows`` rows per
    microbatch measured (``measured.a2a_f`` / ``a2a_b``: ``calibrated_costs(..., exchanges=)``):
    the estimate scaled by measured over estimated, fixed part alike, or where there was no
    estimate the measurement scaled with the rows (Note [all-to-all estimate]).  As they are
    where the trial measured none."""
    if not any(measured.values("a2a_f") + measured.values("a2a_b")):
        return list(costs)
    out = []
    for s, cost in enumerate(costs):
        at = cost.at(rows) if rows else cost
        fields = {}
        for kind in ("f", "b"):
            got, had = measured.at(f"a2a_{kind}", s), getattr(at, f"a2a_{kind}")
            if had > 0:
                k = got / had
                fields.update({f"a2a_{kind}": getattr(cost, f"a2a_{kind}") * k,
                               f"a2a_{kind}0": getattr(cost, f"a2a_{kind}0") * k})
            else:
                fields.update({f"a2a_{kind}": got * (cost.rows / rows if rows else 1.0), f"a2a_{kind}0": 0.0})
        out.append(dataclasses.replace(cost, **fields))
    return out
