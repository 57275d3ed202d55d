"""Each actor's peak memory under a schedule: the accounting ``schedule="auto"``, the dry run
of ``mpmd train`` and ``python -m mpmd bench peaks`` share (Note [memory phases] and Note
[recomputed phases] in phases.py say where its terms come from)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple, Optional

from schedules import PREFETCH, Kind

from .costs import StageCost

__all__ = ["rank_memory", "MoESpec", "MoELayerBytes", "moe_layer_bytes"]

# Note [memory at cp]
# With context parallelism (``Pipeline(cp=C)``, docs/context.md) each of a stage's C actors
# holds the zigzag shard of S/C tokens of every microbatch, and every activation byte the
# model counts is per token: a layer's saved inputs and outputs, the logits, the gradients W
# starts from, the boundary tensors sent and received, a MoE layer's dispatched rows and
# all-to-all buffers.  The attention keeps no more: the ring's autograd saves the shard's own
# q, k, v, output and a float32 log-sum-exp per query row (Note [ring attention] in
# actors/context.py; 0.50x of cp=1 measured per call at cp=2), never another shard's K/V.  So
# an actor's activations are the whole sequence's over C.  Not counted: the ring's transient
# buffers, one other shard's K and V (and, in the backward, their dK/dV accumulators) in
# flight during one layer's attention at a time.  Parameters, gradients and the optimizer
# state are not sharded by CP: every CP rank holds its stage's whole (the gradients are
# averaged over the dp x cp actors).


def rank_memory(sched, costs: list[StageCost], optimizer_state_factor: float, tp: int = 1, ep: int = 1,
                expert_state_factor: Optional[float] = None, cp: int = 1) -> list[float]:
    """Per rank: parameter, gradient and optimizer bytes (one TP rank's; of the routed experts,
    ``expert_bytes``, the ``1/ep`` one EP rank holds, with ``expert_state_factor`` of optimizer
    state, default ``optimizer_state_factor``: ZeRO-1 does not split it) plus the peak live
    activation bytes (whole: Note [TP cost model] in tp.py).  A recomputed stage holds its
    input and output per microbatch in flight, and its recomputed activations during its
    backward: while ``B`` runs, or from ``I`` to ``W`` (Note [recompute at I] in actors/stage_exec.py); where its
    recomputed phases were measured, what they measured (Note [recomputed phases] in
    phases.py); and the receives it posts ahead, ``PREFETCH`` of its largest (Note [receive
    prefetch] in actors/transfers.py).  With ``cp`` context-parallel ranks (Note [memory at cp])
    each actor of a rank holds one shard of every microbatch: the activation terms are the
    costs' (whole sequences) over ``cp``, the parameter terms whole."""
    phases = {(s, split): _Phases.of(c, split) for s, c in enumerate(costs) for split in (False, True)}
    owner = {s: r for r in range(sched.num_ranks) for s in sched.stages_of(r)}
    out = []
    for r, acts in enumerate(sched.ranks):
        mine = sched.stages_of(r)
        received = sorted([costs[s].in_bytes for s in mine if s > 0 and owner[s - 1] != r]
                          + [costs[s].out_bytes for s in mine if s + 1 < len(costs) and owner[s + 1] != r])
        live = peak = 0.0
        for a, beside in _beside(acts, costs):
            c = phases[(a.stage, sched.backward_of(a.stage, a.microbatch) is Kind.I)]  # split: I and W
            if a.kind is Kind.F:  # its temporaries, then what the microbatch keeps
                peak = max(peak, live + c.keep + c.f_peak)
                live += c.keep
            elif a.kind is Kind.B:  # a recomputed forward's activations and the backward's own
                peak = max(peak, live + c.b_peak + beside)
                live -= c.keep
            elif a.kind is Kind.I:  # then what W reads (and starts from) stays until W
                peak = max(peak, live + c.i_peak + beside)
                live += c.held_to_w - c.keep
                peak = max(peak, live)
            elif a.kind is Kind.W:
                peak = max(peak, live + c.w_peak)
                live -= c.held_to_w
        experts = sum(costs[s].expert_bytes for s in mine)
        dense = sum(costs[s].params_at(tp) for s in mine) - experts
        expert_factor = optimizer_state_factor if expert_state_factor is None else expert_state_factor
        out.append(dense * (2.0 + optimizer_state_factor) + experts / ep * (2.0 + expert_factor)
                   + (peak + sum(received[-PREFETCH:])) / cp)  # Note [memory at cp]
    return out


def _beside(acts, costs: list[StageCost]):
    """``(action, beside)`` of each single action: an OVERLAP's parts in turn, its backward
    with ``beside`` its forward's temporaries (the two interleave, so the backward peaks while
    they are alive); 0 elsewhere."""
    for top in acts:
        if top.parts is None:
            yield top, 0.0
        else:
            forward, backward = top.parts
            yield forward, 0.0
            yield backward, costs[forward.stage].f_peak


class _Phases(NamedTuple):
    """One microbatch of a stage as ``rank_memory`` walks it: what F leaves (``keep``), each
    phase's peak above what was live when it began (``F``'s above what it leaves), and what
    stays from I to W."""
    keep: float
    f_peak: float
    b_peak: float
    i_peak: float
    w_peak: float
    held_to_w: float

    @classmethod
    def of(cls, c: StageCost, split: bool) -> "_Phases":
        # measured recomputed (the received input, alive till FREE, besides what the phases allocated)
        if c.recompute and split and c.rs_held:  # recomputed at I
            return cls(c.in_bytes + c.rs_held, c.f_peak, c.recompute_bytes + c.b_peak, c.ri_peak, c.rw_peak,
                       c.in_bytes + c.ri_held)
        if c.recompute and not split and c.r_held:  # checkpointed
            return cls(c.in_bytes + c.r_held, c.f_peak, c.rb_peak, c.recompute_bytes + c.i_peak, c.w_peak,
                       _held_to_w(c))
        # measured without recompute, or the structural estimate (analytic costs: the dry run)
        return cls(c.act_bytes, c.f_peak, c.recompute_bytes + c.b_peak, c.recompute_bytes + c.i_peak, c.w_peak,
                   _held_to_w(c))


def _held_to_w(c: StageCost) -> float:
    """What a microbatch keeps from its I to its W: measured (Note [memory phases] in
    phases.py), else its activations, the gradients W starts from and a recomputed graph."""
    return c.i_held if c.i_held else c.act_bytes + c.seed_bytes + c.recompute_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESpec:
    """The experts of a mixture-of-experts decoder (what the memory model and the dry run need):
    ``num_experts`` routed experts per MoE layer, ``top_k`` of them per token, each a SwiGLU MLP
    of width ``expert_intermediate_size``; ``num_shared_experts`` dense MLPs every token passes
    (DeepSeek's; width ``shared_intermediate_size``, default the routed experts'); the first
    ``first_dense_layers`` decoder layers have a dense MLP instead (DeepSeek-V3: 3)."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    num_shared_experts: int = 0
    shared_intermediate_size: Optional[int] = None
    first_dense_layers: int = 0

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "expert_intermediate_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"MoESpec.{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoESpec.top_k ({self.top_k}) is more than num_experts ({self.num_experts}): a token "
                             f"cannot go to more experts than there are; use top_k <= {self.num_experts}")
        if self.num_shared_experts < 0 or self.first_dense_layers < 0:
            raise ValueError("MoESpec.num_shared_experts and first_dense_layers must be >= 0")

    def is_moe_layer(self, index: int) -> bool:
        """Whether decoder layer ``index`` has experts."""
        return index >= self.first_dense_layers

    def expert_params(self, hidden_size: int) -> int:
        """One MoE layer's routed-expert parameters, all experts (``gate_up_proj [E, 2I, H]``,
        ``down_proj [E, H, I]``)."""
        return self.num_experts * 3 * hidden_size * self.expert_intermediate_size

    def replicated_params(self, hidden_size: int) -> int:
        """One MoE layer's parameters besides its routed experts: the router and the shared experts."""
        shared = self.shared_intermediate_size or self.expert_intermediate_size
        return self.num_experts * hidden_size + self.num_shared_experts * 3 * hidden_size * shared


class MoELayerBytes(NamedTuple):
    """One MoE layer's MLP on one actor (``moe_layer_bytes``)."""
    expert_params: int  # this actor's routed-expert parameters: num_experts / ep of them
    replicated_params: int  # the router's and the shared experts' (every replica holds them whole)
    state_bytes: float  # weights, gradients and AdamW's moments of both (float32)
    act_bytes: float  # what one microbatch keeps from its F to its backward
    seed_bytes: float  # what a split backward holds from I to W (the gradients at the matmuls' outputs)
    a2a_bytes: float  # the all-to-all buffers in flight while it runs F, and again in its backward


def moe_layer_bytes(moe: MoESpec, *, hidden_size: int, tokens: int, ep: int = 1, dp: int = 1, zero: int = 0,
                    element_bytes: float = 2.0, imbalance: float = 1.0) -> MoELayerBytes:
    """Per actor, the bytes of one MoE layer's MLP (router, routed and shared experts) for a
    microbatch of ``tokens`` tokens (rows x sequence) on this actor, with the experts split over
    ``ep`` replicas (Note [expert parallelism] in actors/grid.py) of ``dp``.

    Parameters (float32 masters, Note [dry-run memory] in mpmd/lm/dry_run.py): the actor holds
    ``num_experts / ep`` routed experts, ``3 * H * I`` each, and the router (``E * H``) and
    shared experts whole.  State: 4 bytes of weight and 4 of gradient per parameter, and
    AdamW's two float32 moments: 8 bytes per expert parameter (ZeRO-1 does not split them: the
    experts are already split over ``ep``, each actor steps its own), ``8 / dp`` per replicated
    one under ``zero=1`` (else 8).

    Activations kept per token, at ``element_bytes`` (2 at bf16/fp16, 4 at fp32): the layer's
    input (the router's and the shared experts' matmuls keep it), the router's float32 logits
    and probabilities (``2 * E * 4`` bytes: an fp32 router), per routed slot (``top_k`` of
    them) the dispatched row (``H``: the dispatch's receive buffer, kept by the expert's first
    matmul), ``gate_up`` (``2I``), ``act(gate)`` and its product with ``up`` (``2I``) and the
    expert's output come back (``H``: the combine's receive buffer, kept for the weighting's
    gradient); per shared expert ``4 * I_shared``.  ``seed_bytes``: the gradient at each
    matmul's output (``top_k * (2I + H)``, shared ``2I_shared + H`` each).

    All-to-all buffers (``a2a_bytes``): the dispatch's and the combine's send buffers, each
    ``tokens * top_k`` rows of ``H`` (the receive buffers are the activations above): live while
    the layer runs F, and in its backward as the reverse exchanges' buffers: one layer at a
    time.  Routing is dropless: a member receives ``tokens * top_k`` rows on average and at
    most ``ep`` times that (every token of the group sent to its experts); ``imbalance``
    scales what it receives (1: balanced)."""
    if ep < 1 or moe.num_experts % ep:
        raise ValueError(f"ep={ep} must divide the {moe.num_experts} experts of each MoE layer")
    h, k = hidden_size, moe.top_k
    shared_i = moe.shared_intermediate_size or moe.expert_intermediate_size
    experts = moe.expert_params(h) // ep
    replicated = moe.replicated_params(h)
    adam = 8.0
    state = experts * (8.0 + adam) + replicated * (8.0 + (adam / dp if zero else adam))
    routed_rows = tokens * k * imbalance
    act = (tokens * h + routed_rows * (2 * h + 4 * moe.expert_intermediate_size)
           + tokens * 4 * shared_i * moe.num_shared_experts) * element_bytes + tokens * 2 * moe.num_experts * 4.0
    seeds = (routed_rows * (2 * moe.expert_intermediate_size + h)
             + tokens * moe.num_shared_experts * (2 * shared_i + h)) * element_bytes
    a2a = 2.0 * tokens * k * h * element_bytes
    return MoELayerBytes(experts, replicated, state, act, seeds, a2a)
