"""What a run of ``mpmd train`` is predicted to cost (per stage FLOPs, the simulated step,
per actor memory: Note [dry-run memory] in dry_run.py), and how many decoder layers each
stage gets.

Note [balanced layers]
~~~~~~~~~~~~~~~~~~~~~~
``parallel.layers = "equal"`` gives every stage the same number of decoder layers (the
remainder to the middle stages).  The stages then cost the same but for the ends: the first
stage's embedding is a lookup, but the last stage's LM head is a matmul of ``hidden x
vocab`` (Llama-3-8B's: 525M parameters, 2.4 decoder layers' worth of FLOPs).  Under a V
schedule (zbv, dualpipev) the first and the last stage share rank 0, so with 2 layers per
stage that rank computes 6.4 layers' worth where the others compute 4, and every rank waits
for it.

``"balanced"`` lets the dry run's cost model choose: starting from the equal split it tries
every move of one layer from one stage to another (each stage keeps at least one), simulates
each, and takes the move with the shortest predicted step among those that fit
``memory_limit_gb``, until no move shortens it.  Where the split does not fit, moves that
lower the largest overflow come first.  The search is deterministic, so a resumed run gets the
same stages; ``mpmd train`` logs the counts, and ``layers = [...]`` pins them.  A run that
resumes builds the stages its checkpoint was written with (read from the checkpoint's keys):
``"balanced"`` adopts them, whatever the search would choose now, and an explicit split that
differs is refused with the list to set (``resumed_layers``).

What is simulated is the program the actors run (``lower_for_training``: sends, receives
sunk after the work a rank can do before their consumer, frees), each rank in its order with
``PREFETCH`` receives posted ahead (``schedules.simulate_lowered``), at per stage FLOPs a
third each for F, I and W; memory is the planner's walk over the schedule.  The schedule's
order was made for equal stages, and the ranks' fixed order, not only their loads, decides
where an unequal split waits: on CPU actors, interleaved-1f1b (m=8) balanced for the schedule
alone chose [1, 2, 4, 1] and measured no faster than equal (1.009), while the program-level
search chose [3, 2, 2, 1] and measured 0.928 and 0.944 against 0.928 predicted (docs/train.md
has the table).
For the shipped 8B config (16 stages, dualpipev on 8 ranks) it predicts 2.37 s at peak FLOP/s
against 2.78 s with equal layers.  Where a layer goes matters beyond the ranks' loads: moving
one from stage 15 to 14 predicts 2.40 s, one from stage 0 and one from 15 to stages 1 and 14
2.78 s, no better than equal.

The model counts FLOPs only: messages, the optimizer step and the actors' own costs are free.
On CPU actors, where those costs are a few percent of a stage's pass, the measured gain fell
short of the predicted one by up to 6 points under the V schedules (``python -m mpmd bench
layers`` prints both)."""

from __future__ import annotations

import os
import re
from typing import Callable, Optional

import torch

import schedules

from ..planning import StageCost, rank_memory
from ..planning.a2a import exchange_seconds
from ..planning.measure import DEFAULT_BYTES_PER_S, DEFAULT_LATENCY_S
from ..planning.memory import moe_layer_bytes
from ..runtime import PipelineConfig, build_schedule
from ..runtime.compile import lower_for_training
from ..training.checkpoint import latest_checkpoint, read_manifest
from .config import SCHEDULE_AUTO, TrainConfig
from .config_io import ConfigError
from .flops import attention_widths, layer_matmul_params, layer_norm_params
from .models import LlamaSpec, layer_counts

__all__ = ["plan_schedule", "stage_exchanges", "lowered", "simulate_plan", "stage_params", "stage_flops", "stage_layer_counts", "moe_layers",
           "expert_parallel",
           "balanced_layers", "balance_hint", "saved_layer_counts", "resumed_layers"]

_LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.")


def plan_schedule(cfg: TrainConfig, name: Optional[str] = None, overlap=None) -> schedules.Schedule:
    """The schedule the Pipeline of ``cfg`` builds (``name``: another schedule's, for auto;
    ``overlap``: instead of ``parallel.overlap``, docs/overlap.md)."""
    p = cfg.parallel
    config = PipelineConfig.from_options(num_actors=p.actors, dp=p.dp, device=p.device, ep=p.ep, cp=p.cp,
                                         overlap=p.overlap if overlap is None else overlap)
    return build_schedule(name or p.schedule, p.stages, config, p.microbatches)


def stage_exchanges(cfg: TrainConfig, spec: LlamaSpec, counts: list) -> list[tuple[float, float]]:
    """Per stage, the seconds of expert all-to-all in one forward and one input-gradient backward
    of a microbatch (Note [all-to-all estimate] in mpmd/planning/a2a.py: the device kind's assumed
    link); zeros without experts or at ``ep == 1``."""
    p = cfg.parallel
    device = "cuda" if p.device == "cuda" or (p.device == "auto" and torch.cuda.is_available()) else "cpu"
    tokens = cfg.optim.batch_size // (p.microbatches * p.dp) * cfg.data.seq_len / p.cp  # an actor's CP shard
    hidden = tokens * spec.hidden_size * (4.0 if p.precision == "fp32" else 2.0)
    top_k = spec.moe.top_k if spec.moe is not None else 0
    return [exchange_seconds(hidden, [top_k] * moe_layers(spec, counts, s), expert_parallel(cfg),
                             DEFAULT_LATENCY_S[device], DEFAULT_BYTES_PER_S[device])[:2] for s in range(len(counts))]


def stage_params(spec: LlamaSpec, counts: list) -> list[int]:
    """Parameters per stage of the Llama ``spec`` cut into ``counts`` decoder layers per stage:
    each layer's projections and two norms (a MoE layer's router and experts, all of them, for
    its MLP), the embedding on the first stage, the final norm and the (untied) head on the last."""
    h = spec.hidden_size
    layers = [layer_matmul_params(spec, i) + layer_norm_params(spec) for i in range(sum(counts))]  # and its norms
    ends = [0] * len(counts)
    ends[0] += spec.vocab_size * h
    ends[-1] += h + spec.vocab_size * h
    return [sum(layers[a:a + c]) + e for a, c, e in zip(_starts(counts), counts, ends)]


def _starts(counts: list) -> list[int]:
    """The first decoder layer of each stage."""
    return [sum(counts[:s]) for s in range(len(counts))]


def _inactive(spec: LlamaSpec, counts: list) -> list[int]:
    """Per stage, the routed experts' parameters a token does not use (Note [MFU] in flops.py)."""
    return [sum(layer_matmul_params(spec, i) - layer_matmul_params(spec, i, active=True) for i in range(a, a + c))
            for a, c in zip(_starts(counts), counts)]


def moe_layers(spec: LlamaSpec, counts: list, stage: int) -> int:
    """The decoder layers of ``stage`` that have experts (none but the first ``first_dense_layers``
    when ``spec.moe``)."""
    if spec.moe is None:
        return 0
    first = sum(counts[:stage])
    return sum(spec.moe.is_moe_layer(i) for i in range(first, first + counts[stage]))


def expert_parallel(cfg: TrainConfig) -> int:
    """``parallel.ep``: the dp x cp actors of a stage a MoE layer's experts are split over."""
    return cfg.parallel.ep


def stage_flops(cfg: TrainConfig, spec: LlamaSpec, params: list, counts: list) -> list[float]:
    """Training FLOPs of one microbatch per stage and actor (Note [MFU] in flops.py; 1/tp of them,
    and 1/cp: each CP rank computes its shard's tokens and, zigzag-balanced, its share of the attention):
    of a MoE layer's routed experts only the ``top_k`` a token goes to count (its active
    parameters; with ``ep`` each actor computes as many rows, balanced, as without)."""
    p = cfg.parallel
    tokens = cfg.optim.batch_size // (p.microbatches * p.dp) * cfg.data.seq_len
    out = []
    widths = sum(attention_widths(spec))
    for s, (n, c, idle) in enumerate(zip(params, counts, _inactive(spec, counts))):
        matmul = n - idle - (spec.vocab_size * spec.hidden_size if s == 0 else 0)  # the embedding is a lookup
        out.append(tokens * (6.0 * matmul + 6.0 * c * widths * cfg.data.seq_len) / (p.tp * p.cp))
    return out


def lowered(cfg: TrainConfig, sched: schedules.Schedule) -> schedules.Schedule:
    """``sched`` lowered as the Pipeline's actors run it (sends, receives, frees)."""
    return lower_for_training(sched, cfg.parallel.dp)


def simulate_plan(cfg: TrainConfig, spec: LlamaSpec, sched: schedules.Schedule, params: list, counts: list,
                  unit: Optional[float] = None, program: Optional[schedules.Schedule] = None):
    """The simulated step of ``sched`` (a ``SimResult``), the step time in seconds where
    ``run.peak_flops`` is known (else None), and the peak bytes per pipeline rank, for stages
    of ``params`` parameters and ``counts`` decoder layers (Note [dry-run memory]).  Times are
    FLOPs over ``unit``: by default the peak FLOP/s, else the slowest stage's FLOPs.  What is
    simulated is ``program`` (default: ``lowered(cfg, sched)``), each rank running its
    instructions in order and posting ``PREFETCH`` receives ahead as the actors do (Note
    [balanced layers]); messages, the optimizer step and the actors' own costs are free.  The
    experts' all-to-alls (``stage_exchanges``) are charged where the times are seconds (at the
    peak FLOP/s), and an OVERLAP hides them as Note [all-to-all costs] in schedules/costs.py says."""
    p = cfg.parallel
    micro = cfg.optim.batch_size // (p.microbatches * p.dp)
    n = len(params)
    flops = stage_flops(cfg, spec, params, counts)
    peak = cfg.run.peak_flops
    unit = unit or peak or max(flops)
    third = tuple(x / 3 / unit for x in flops)
    program = program or lowered(cfg, sched)
    a2a = stage_exchanges(cfg, spec, counts) if peak and unit == peak else []
    result = schedules.simulate(program, schedules.Costs(f=third, b=third, w=third, prefetch=schedules.PREFETCH,
                                                         **({} if not any(f for f, _ in a2a) else dict(
                                                             a2a_f=[f for f, _ in a2a], a2a_b=[b for _, b in a2a]))))
    stage_costs = [_stage_memory(cfg, spec, params[s], counts[s], micro, s == n - 1, moe_layers(spec, counts, s))
                   for s in range(n)]
    if p.recompute:
        stage_costs = [c.recomputed() for c in stage_costs]
    # float32 weights and gradients (2 x 4 bytes) and AdamW's two moments (ZeRO-1: a share each;
    # the experts' whole on each of the ep actors that split them)
    memory = rank_memory(sched, stage_costs, optimizer_state_factor=2.0 / (p.dp if p.zero else 1), tp=p.tp,
                         ep=expert_parallel(cfg), expert_state_factor=2.0, cp=p.cp)  # Note [memory at cp]
    return result, (result.makespan if peak else None), memory


def _stage_memory(cfg: TrainConfig, spec: LlamaSpec, params: int, num_layers: int, micro: int,
                  last: bool, num_moe: int = 0) -> StageCost:
    """What one stage holds, per microbatch and in parameters, for the planner's accounting
    (Note [dry-run memory]): the same per-actor walk over the schedule as ``schedule="auto"``;
    ``num_moe`` of its layers have experts (``moe_layer_bytes``)."""
    s, h, tp, p = cfg.data.seq_len, spec.hidden_size, cfg.parallel.tp, cfg.parallel
    element = 4.0 if cfg.parallel.precision == "fp32" else 2.0
    per_token = 34.0 if tp == 1 else 30.0 / tp + 4.0  # Note [dry-run memory], in 16-bit units
    # a MoE layer keeps the attention's and the norms' 15 of the 34 (Korthikanti's MLP: 19), and its MLP's own
    dense_layers = num_layers - num_moe
    layers = (dense_layers + num_moe * 15.0 / 34.0) * s * micro * h * per_token * element / 2
    logits = 8.0 * s * micro * spec.vocab_size / tp if last else 0.0  # float32 logits' softmax and gradient
    # What W starts from: the gradient at each linear's output (q, k, v, o; gate, up, down), sharded.
    kv = h * spec.num_kv_heads // spec.num_heads
    seeds = (num_layers * (2 * h + 2 * kv) + dense_layers * (2 * spec.intermediate_size + h)) * s * micro * element / tp
    norms = h * (2 * num_layers + (1 if last else 0))  # the RMSNorm weights stay whole under TP
    experts = peak = 0.0
    if num_moe:
        moe = moe_layer_bytes(spec.moe, hidden_size=h, tokens=s * micro, ep=expert_parallel(cfg), dp=p.dp,
                              zero=p.zero, element_bytes=element)
        layers += num_moe * moe.act_bytes
        seeds += num_moe * moe.seed_bytes
        experts = 4.0 * num_moe * spec.moe.expert_params(h)  # all of them: rank_memory takes 1/ep
        peak = moe.a2a_bytes  # one layer's exchanges in flight at a time, in F and in the backward
    boundary = s * micro * h * element
    return StageCost(f=0.0, b=0.0, w=0.0, act_bytes=layers + logits, in_bytes=boundary,
                     out_bytes=logits if last else boundary, seed_bytes=seeds, param_bytes=4.0 * params,
                     tp_share=(params - norms - experts / 4.0) / params if params else 0.0, expert_bytes=experts,
                     f_peak=peak, b_peak=peak, i_peak=peak, w_peak=peak)


def stage_layer_counts(cfg: TrainConfig, spec: LlamaSpec, log: Optional[Callable[[str], None]] = None) -> list[int]:
    """Decoder layers per stage as ``parallel.layers`` asks (Note [balanced layers])."""
    p = cfg.parallel
    if not isinstance(p.layers, str):
        return list(p.layers)
    equal = layer_counts(spec.num_layers, p.stages)
    if p.layers == "equal":
        return equal
    counts, before, after = balanced_layers(cfg, spec, plan_schedule(cfg))
    if log is not None:
        log(f"layers: balanced for {p.schedule}: {counts}; {_predicted(cfg, before, after)}; pin them with "
            f"parallel.layers = {counts}")
    return counts


def saved_layer_counts(path: str) -> Optional[list[int]]:
    """Decoder layers per stage of the checkpoint at ``path``, read from its stages' keys
    (``model.layers.N.``); None where a stage names none."""
    counts = [len({m.group(1) for m in map(_LAYER_KEY.match, shapes or ()) if m})
              for shapes in read_manifest(path)["stage_shapes"]]
    return counts if all(counts) else None


def resumed_layers(cfg: TrainConfig, counts: list, log: Callable[[str], None] = print) -> list:
    """The layers per stage a run resuming from ``run.dir``'s newest checkpoint builds: that
    checkpoint's, which ``"balanced"`` adopts (the search may choose otherwise once its model
    changes) and an explicit split must equal, else a ``ConfigError`` saying how to resume."""
    r = cfg.run
    found = latest_checkpoint(os.path.join(r.dir, "checkpoints")) if r.resume and r.checkpoint_every else None
    saved = saved_layer_counts(found) if found else None
    if saved is None or saved == list(counts) or len(saved) != len(counts):  # a stage count: the load says so
        return list(counts)
    if cfg.parallel.layers == "balanced":
        log(f"layers: resuming {found}, written with {saved} decoder layers per stage (balanced now gives {counts})")
        return saved
    raise ConfigError(f"run.dir's checkpoint {found} was written with {saved} decoder layers per stage, but "
                      f"parallel.layers gives {list(counts)}: set parallel.layers = {saved} to resume it, or "
                      f"run.resume = false (or another run.dir) to start afresh")


def balance_hint(cfg: TrainConfig, spec: LlamaSpec, at_least: float = 0.05) -> Optional[str]:
    """For an equal split, a line saying what ``layers = "balanced"`` would predict, where that
    is ``at_least`` shorter a step; else None."""
    p = cfg.parallel
    if p.layers != "equal" or p.schedule == SCHEDULE_AUTO or spec.family == "gpt":
        return None
    counts, before, after = balanced_layers(cfg, spec, plan_schedule(cfg))
    if after > (1 - at_least) * before:
        return None
    return f"layers: parallel.layers = \"balanced\" would give {counts}: {_predicted(cfg, before, after)}"


def _predicted(cfg: TrainConfig, before: float, after: float) -> str:
    unit = " s" if cfg.run.peak_flops else " (in the equal split's slowest stage passes)"
    return f"predicted step {after:.3g}{unit} against {before:.3g} with equal layers ({after / before - 1:+.0%})"


def balanced_layers(cfg: TrainConfig, spec: LlamaSpec, sched: schedules.Schedule) -> tuple[list[int], float, float]:
    """Note [balanced layers]: the counts, and the predicted step of the equal split and of them."""
    p = cfg.parallel
    limit = p.memory_limit_gb * 2 ** 30 if p.memory_limit_gb else float("inf")
    counts = layer_counts(spec.num_layers, p.stages)
    # one time unit for every candidate: the peak FLOP/s, else the equal split's slowest stage
    unit = cfg.run.peak_flops or max(stage_flops(cfg, spec, stage_params(spec, counts), counts))
    program = lowered(cfg, sched)

    def score(counts: list) -> tuple[float, float]:
        params = stage_params(spec, counts)
        result, _, memory = simulate_plan(cfg, spec, sched, params, counts, unit, program)
        return max(0.0, max(memory) - limit), result.makespan

    best = start = score(counts)
    while True:
        moves = [(score(c), c) for c in _moves(counts)]
        found = min(moves, key=lambda m: m[0], default=None)
        if found is None or not found[0] < best:
            break
        best, counts = found
    return counts, start[1], best[1]


def _moves(counts: list) -> list[list[int]]:
    """Every split one layer away from ``counts`` (each stage keeping one at least)."""
    out = []
    for i, c in enumerate(counts):
        if c < 2:
            continue
        for j in range(len(counts)):
            if j != i:
                moved = list(counts)
                moved[i] -= 1
                moved[j] += 1
                out.append(moved)
    return out
