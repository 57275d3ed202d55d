"""``schedule="auto"`` and ``num_microbatches="auto"``: measure the stages, simulate every
registered schedule and microbatch count, pick the fastest that fits in memory.

Two layers:

* ``measure_module`` / ``measure_stages`` time one module (or a chain of stage modules)
  on a sample microbatch on the controller, with the same forward / ``I`` / ``W`` /
  fused-backward code the actors run (``actors.stage_exec``), and count the bytes a
  microbatch holds from its forward until its backward releases the graph.
* ``choose_schedule`` is pure (no Ray, no torch compute): given per-stage ``StageCost``
  values it simulates each (schedule, microbatch count) with ``schedules.simulate``,
  estimates every actor's peak memory and returns a ``Decision`` with the whole table.

``plan_pipeline`` joins them for ``mpmd.Pipeline(schedule="auto", sample=...)``.

Note [auto cost model]: costs are measured at every microbatch size a candidate count
gives and interpolated between them (Note [cost curve] in costs.py); through the
smallest and the largest size they also make an affine ``cost(rows) = fixed + slope *
rows``, whose fixed part is what keeps small microbatches from looking free.  A fused
backward ``B`` is timed on its own, so fused schedules are simulated with
``Costs(b=B, w=0)`` and split ones with ``Costs(b=I, w=W, fused=B)`` (a named split
schedule runs its free pairs fused, Note [fused where free] in schedules/fuse.py).  Memory per actor is
parameters x (1 + 1 gradient + ``optimizer_state_factor``, divided by ``dp`` with
``zero=1``) plus the weighted peak of live activations in the actor's action order; an
activation is live from its ``F`` until its ``B``, or until its ``W`` for split backwards:
this runtime's ``I`` keeps the graph (``retain_graph=True``) for ``W``, unlike the
simulator's count (Note [activation accounting] in schedules/simulate.py) that ends at
``I``.  Unless ``zero`` is pinned, ``zero=1`` is chosen only where nothing fits without it.
With ``tp`` choices every option is simulated at each (Note [TP cost model] in tp.py):
per TP rank, the sharded share of compute and of the parameter state divided by ``tp``,
the TP all-reduces charged in the forward and the input-gradient backward.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import statistics
from typing import Any, Callable, Optional, Sequence, Union

import torch

import schedules
from actors.experts import find_moe_blocks
from actors.update import autocast_dtype
from actors.values import flatten
from schedules import Kind

from ..runtime import LayoutConfig, PipelineConfig, StageSource, build_schedule
from ..runtime.batches import split_batch
from ..runtime.devices import resolve_device
from .a2a import with_exchanges
from .costs import RuntimeTerms, StageCost, a2a_terms, tp_terms
from .decision import Decision, Option, fmt_bytes
from .away import measure_away, measure_here
from .measure import DEFAULT_BYTES_PER_S, DEFAULT_LATENCY_S, default_memory_limit
from .memory import rank_memory
from .tp import tp_candidates, tp_profile

__all__ = ["StageCost", "Option", "Decision", "choose_schedule", "default_memory_limit", "plan_pipeline", "rank_memory",
           "MAX_AUTO_MICROBATCHES"]

log = logging.getLogger(__name__)

# num_microbatches="auto" tries the divisors of the per-replica batch up to this.
MAX_AUTO_MICROBATCHES = 64
# Registered schedules schedule="auto" leaves out, and why (they need special stages).
_NOT_AUTO = {"terapipe": "runs token slices: needs stages that keep key/value context (see mpmd.terapipe)"}


# -- the decision (pure) ---------------------------------------------------------------------------


def choose_schedule(stage_costs: Sequence[StageCost], *, memory_limit_bytes: float,
                    batch_size: Optional[int] = None, microbatches: Optional[Sequence[int]] = None,
                    schedule_names: Optional[Sequence[str]] = None, num_ranks: Optional[int] = None,
                    comm_latency_s: float = 0.0, bytes_per_s: float = math.inf,
                    optimizer_state_factor: float = 2.0,
                    recompute: Union[None, bool, Sequence[int]] = None,
                    runtime: Optional[RuntimeTerms] = None, dp: int = 1, zero: Optional[int] = 0,
                    tp: Union[int, Sequence[int]] = 1, tp_latency_s: float = 0.0,
                    tp_bytes_per_s: float = math.inf, ep: int = 1, overlap: Union[str, bool] = "auto") -> Decision:
    """Simulate every (schedule, microbatch count) and pick the fastest that fits.

    ``stage_costs[s]`` is stage ``s``'s ``StageCost``.  With ``batch_size`` (rows per
    replica per step) the costs of ``m`` microbatches are ``stage_costs[s].at(batch_size /
    m)``, and ``microbatches`` defaults to the divisors of ``batch_size`` up to
    ``MAX_AUTO_MICROBATCHES``; without it the costs are taken as they are for every
    ``m`` and ``microbatches`` defaults to 1, 2, 4, ..., 32.  ``schedule_names`` defaults
    to every registered schedule but the token-sliced ``terapipe``; each is placed as ``mpmd.Pipeline`` would place it
    (on ``num_ranks`` pipeline ranks, or at the schedule's default stages per rank), and a combination
    its constraints refuse is skipped.  A hop costs ``comm_latency_s + out_bytes /
    bytes_per_s`` (the mean over the stage boundaries).  Memory: Note [auto cost model].
    ``recompute``: True (every stage) or stage indices to model as recomputed
    (``StageCost.recomputed``), False for none; None (the default) tries every option
    without recompute first and, only if none fits, every option recomputing all stages.
    ``zero``: 1 models the optimizer state split over ``dp`` replicas (``optimizer_state_factor
    / dp``); None (``Pipeline(zero=...)`` not given) tries ``zero=0`` first and, with ``dp > 1``,
    ``zero=1`` only if nothing fits with every replica holding all of it (before recompute).

    The fastest option within ``memory_limit_bytes`` wins (ties: less memory, fewer
    microbatches, name).  Raises ``ValueError`` when none fits, saying the least memory
    any option needs.

    ``runtime``: the runtime's own costs measured on actors (``RuntimeTerms``); each option
    is then lowered as the engine runs it and simulated at instruction level (Note
    [calibrated auto] in replan.py) instead of with the flat hop above.

    ``tp``: the tensor-parallel degree, or a tuple of them to choose from (another
    dimension of the options, Note [TP cost model] in tp.py): at ``tp=T`` a rank computes
    and holds ``1 / T`` of each stage's ``tp_share`` and pays its TP all-reduces, each
    ``tp_latency_s + 2 (T - 1) / T * tp_bytes / tp_bytes_per_s``; ``memory_limit_bytes``
    is still per actor (a pipeline rank is ``T`` actors, ``dp * pp * T`` in all).

    ``ep``: each stage's routed experts (``StageCost.expert_bytes``) split over ``ep`` replicas,
    each holding ``1/ep`` of them with their whole optimizer state (``zero`` splits only the
    rest: Note [expert parallelism] in actors/grid.py).

    ``overlap`` (``Pipeline(overlap=...)``, docs/overlap.md): a schedule with forward-backward
    pairs (dualpipev) is simulated with them as OVERLAPs and without under ``"auto"`` at ``ep >
    1``, only with them under ``True`` (a schedule without pairs is then refused), never under
    ``False``; the stages' all-to-alls (``StageCost.a2a_f``, ``a2a_b``) are charged either way
    (Note [all-to-all costs] in schedules/costs.py), and the faster wins like any option.
    """
    stage_costs = list(stage_costs)
    if not stage_costs:
        raise ValueError("choose_schedule needs one StageCost per stage, got none")
    if not memory_limit_bytes > 0:
        raise ValueError(f"memory_limit_bytes must be > 0, got {memory_limit_bytes!r}")
    if schedule_names is None:
        names = [n for n in schedules.schedule_names() if n not in _NOT_AUTO]
        skipped_names = [(n, 0, why) for n, why in _NOT_AUTO.items() if n in schedules.schedule_names()]
    else:
        names, skipped_names = list(schedule_names), []
    ms = _microbatch_candidates(batch_size, microbatches)
    options: list[Option] = []
    skipped: list[tuple[str, int, str]] = list(skipped_names)
    everything = tuple(range(len(stage_costs)))
    rcs = [()] if recompute in (None, False) else [everything if recompute is True else tuple(sorted(recompute))]
    zeros = (0, 1) if zero is None and dp > 1 else (zero or 0,)
    tps, tp_link = tp_candidates(tp), (tp_latency_s, tp_bytes_per_s)
    overlaps = (False, True) if overlap == "auto" and ep > 1 else (overlap is True,)
    passes = [(rc, z) for rc in rcs + ([everything] if recompute is None else []) for z in zeros]
    for rc, z in passes:
        if (rc, z) != passes[0] and any(o.fits for o in options):
            break  # sharding, then recompute, only when nothing fits without them
        for name in names:
            for m in ms:
                costs = [c.at(batch_size / m) for c in stage_costs] if batch_size else stage_costs
                costs = [c.recomputed() if s in rc else c for s, c in enumerate(costs)]
                for o in overlaps if schedules.schedule_info(name).overlapped is not None else (overlap is True,):
                    try:  # the placement the Pipeline uses, its pairs as OVERLAPs with o
                        sched = build_schedule(name, len(stage_costs), PipelineConfig(layout=LayoutConfig(
                            pp=num_ranks, overlap=o)), m)
                        for t in tps:
                            terms = runtime and dataclasses.replace(runtime, zero=z, tp=t, tp_latency=tp_latency_s,
                                                                    tp_bandwidth=tp_bytes_per_s)
                            options.append(_evaluate(sched, name, costs, memory_limit_bytes, comm_latency_s,
                                                     bytes_per_s, optimizer_state_factor / dp if z
                                                     else optimizer_state_factor, rc, terms, z, t, tp_link, ep,
                                                     optimizer_state_factor, o))
                    except ValueError as e:  # the schedule's constraints (or a plan the simulator cannot finish)
                        if (rc, z) == passes[0] and (name, m, str(e)) not in skipped:  # once, not per overlap
                            skipped.append((name, m, str(e)))
    if not options:
        why = "; ".join(sorted({f"{n}: {w}" for n, _, w in skipped})[:4])
        raise ValueError(f"no schedule accepts {len(stage_costs)} stages with num_microbatches in {ms}"
                         f"{f' and num_actors={num_ranks}' if num_ranks else ''}: {why}")
    options.sort(key=lambda o: (o.step_s, o.peak_bytes, o.tp, o.num_microbatches, o.schedule, o.zero, o.overlap))
    fitting = [o for o in options if o.fits]
    if not fitting:
        least = min(options, key=lambda o: (o.peak_bytes, o.step_s))
        raise ValueError(
            f"no schedule fits memory_limit_bytes={memory_limit_bytes:,.0f} ({fmt_bytes(memory_limit_bytes)}) "
            f"per actor: "
            f"the smallest option, {least.schedule} with num_microbatches={least.num_microbatches} on "
            f"{least.num_ranks} actors{f' at tp={least.tp}' if len(tps) > 1 or least.tp > 1 else ''}"
            f"{' recomputing every stage' if least.recompute else ''}, needs "
            f"{least.peak_bytes:,.0f} bytes ({fmt_bytes(least.peak_bytes)}) on its busiest actor"
            f"{' with zero=1' if least.zero else ''}; raise memory_limit_bytes to at least "
            f"{math.ceil(least.peak_bytes)}, cut the model into more stages, use a smaller batch"
            f"{f', try tp={2 * least.tp} (more devices per stage)' if len(tps) > 1 and least.tp == max(tps) else ''}"
            f"{', or pass zero=1 with dp > 1 (the replicas split the optimizer state)' if not least.zero else ''}")
    best = fitting[0]
    chosen = [c.at(batch_size / best.num_microbatches) for c in stage_costs] if batch_size else stage_costs
    chosen = [c.recomputed() if s in best.recompute else c for s, c in enumerate(chosen)]
    return Decision(schedule=best.schedule, num_microbatches=best.num_microbatches, num_ranks=best.num_ranks,
                    predicted_step_s=best.step_s, peak_bytes=best.peak_bytes,
                    memory_limit_bytes=memory_limit_bytes, options=tuple(options), skipped=tuple(skipped),
                    stage_costs=tuple(chosen), recompute=best.recompute, model_costs=tuple(stage_costs), zero=best.zero,
                    tp=best.tp, overlap=best.overlap,
                    request=dict(memory_limit_bytes=memory_limit_bytes, batch_size=batch_size, microbatches=ms,
                                 schedule_names=schedule_names, num_ranks=num_ranks, comm_latency_s=comm_latency_s,
                                 bytes_per_s=bytes_per_s, optimizer_state_factor=optimizer_state_factor,
                                 recompute=recompute, dp=dp, zero=zero, tp=tp, tp_latency_s=tp_latency_s,
                                 tp_bytes_per_s=tp_bytes_per_s, ep=ep, overlap=overlap))


def _microbatch_candidates(batch_size: Optional[int], microbatches: Optional[Sequence[int]]) -> list[int]:
    if microbatches is not None:
        ms = sorted(set(microbatches))
        bad = [m for m in ms if not isinstance(m, int) or m < 1 or (batch_size and batch_size % m)]
        if bad or not ms:
            raise ValueError(f"microbatch counts must be positive integers dividing the batch size ({batch_size}), "
                             f"got {list(microbatches)!r}")
        return ms
    if batch_size:
        return [m for m in range(1, min(batch_size, MAX_AUTO_MICROBATCHES) + 1) if batch_size % m == 0]
    return [1, 2, 4, 8, 16, 32]


def _evaluate(sched, name: str, costs: list[StageCost], limit: float, latency: float, bytes_per_s: float,
              optimizer_state_factor: float, recompute: tuple[int, ...], runtime: Optional[RuntimeTerms],
              zero: int, tp: int = 1, tp_link: tuple[float, float] = (0.0, math.inf), ep: int = 1,
              expert_state_factor: Optional[float] = None, overlap: bool = False) -> Option:
    split = any(sched.backward_kind[s] is Kind.I for s in range(sched.num_stages))
    if runtime is not None:
        sim = runtime.simulate(sched, costs, split)
        step = sim.step_time
    else:
        boundary = [c.out_bytes for c in costs[:-1]]
        hop = latency + (statistics.fmean(boundary) / bytes_per_s if boundary else 0.0)
        sim = schedules.simulate(sched, schedules.Costs(
            f=[c.f for c in costs], b=[c.b if split else c.full for c in costs],
            w=[c.w if split else 0.0 for c in costs], fused=[c.full for c in costs], comm=hop,
            **tp_terms(costs, tp, *tp_link), **a2a_terms(costs)))
        step = sim.makespan
    peak = max(rank_memory(sched, costs, optimizer_state_factor, tp, ep, expert_state_factor))
    return Option(schedule=name, num_ranks=sched.num_ranks, num_microbatches=sched.num_microbatches,
                  step_s=step, bubble_fraction=sim.bubble_fraction, peak_bytes=peak, fits=peak <= limit,
                  recompute=recompute, zero=zero, tp=tp, overlap=overlap,
                  a2a_s=max(w + h for w, h in zip(sim.all_to_all, sim.all_to_all_hidden)) if sim.all_to_all else 0.0,
                  a2a_hidden_s=max(sim.all_to_all_hidden, default=0.0))


# -- for the Pipeline ----------------------------------------------------------------------------


def plan_pipeline(stages: Union[Sequence[torch.nn.Module], StageSource], schedule: Any, config: PipelineConfig,
                  sample: Any, loss_fn: Optional[Callable], *, num_microbatches: Any, repeats: int = 5,
                  verbose: bool = True, resolve_tp: Optional[Callable] = None,
                  away: Optional[bool] = None) -> Decision:
    """Measure ``stages`` on ``sample`` and decide the schedule and/or microbatch count.

    ``stages``: modules (measured as copies, together), or a ``StageSource`` with factories
    (each stage built, measured and freed before the next: Note [stage factories]).

    ``sample`` is one step's batch, ``(inputs, targets)`` as ``Pipeline.step`` takes it
    (all ``dp`` replicas).  ``schedule`` is ``"auto"`` or a registered name (then only
    ``num_microbatches`` is chosen); ``num_microbatches`` is ``"auto"`` or fixed.
    ``config.planning.choose_zero`` (the user did not pass ``zero``): ``zero=1`` where only it fits.
    ``config.layout.tp`` a tuple: the tensor-parallel degree is chosen too (Note [TP cost model] in
    tp.py); ``resolve_tp(modules, tp_plan, tp)`` (``mpmd.tensor_parallel.resolve_plans``)
    gives the per-stage plans the actors would apply, read for each stage's sharded share
    and collectives (without it, ``config.layout.tp_plan`` is read by name); a choice it refuses
    is left out (listed with the refused options).  ``away`` (default: on CUDA) measures in a
    Ray task placed as an actor, under the run's precision, and never on this process's
    GPU (Note [measured where it runs] in away.py).
    """
    if isinstance(schedule, schedules.Schedule):
        raise ValueError("num_microbatches='auto' or tp choices need a schedule name (or 'auto'); a schedules.Schedule "
                         f"fixes num_microbatches={schedule.num_microbatches}, so pass that")
    if schedule != "auto":
        schedules.schedule_info(schedule)  # unknown names fail here, listing the registered ones
    if sample is None:
        raise ValueError("schedule='auto' / num_microbatches='auto' / tp choices measure the stages on a sample batch: "
                         "pass sample=(inputs, targets), one step's batch, e.g. the first batch of your data")
    try:
        inputs, targets = sample
    except (TypeError, ValueError):
        raise ValueError("sample must be a pair (inputs, targets), one step's batch as Pipeline.step takes it") \
            from None
    _, tensors = flatten(inputs, where="sample inputs")
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("sample inputs need a tensor with a leading batch dimension")
    batch = tensors[0].shape[0]
    layout, cluster = config.layout, config.cluster
    if batch % layout.dp:
        raise ValueError(f"sample batch size {batch} does not split over dp={layout.dp} replicas")
    per_replica = batch // layout.dp
    fixed_m = None if num_microbatches == "auto" else num_microbatches
    ms = [fixed_m] if fixed_m else _microbatch_candidates(per_replica, None)
    if fixed_m and per_replica % fixed_m:
        raise ValueError(f"sample batch size {batch} does not split into num_microbatches={fixed_m} x dp={layout.dp}")
    # The engine's resolution (fractional GPUs count), so the stages are measured where they will run.
    placement = resolve_device(cluster.device, cluster.num_gpus,
                               (layout.pp or len(stages)) * layout.dp * max(layout.tp_choices))
    device = placement.device
    threads = max(1, int(cluster.num_cpus))
    sizes = sorted({per_replica // m for m in ms})  # every candidate size: Note [cost curve] in costs.py

    def microbatch(rows: int) -> tuple[Any, Any]:
        parts = batch // rows
        mb_in = split_batch(inputs, parts, "sample inputs", f"{parts} microbatches of {rows}")[0]
        mb_tg = split_batch(targets, parts, "sample targets", f"{parts} microbatches of {rows}")[0] \
            if targets is not None and loss_fn is not None else None
        return mb_in, mb_tg

    samples = [microbatch(rows) for rows in sizes]
    dtype = autocast_dtype(config.recipe.precision)
    autocast = (device, dtype) if dtype is not None else None
    total = None
    if away if away is not None else device == "cuda":  # Note [measured where it runs]
        per_size, total = measure_away(stages, samples, loss_fn=loss_fn, repeats=repeats, placement=placement,
                                       threads=threads, autocast=autocast, address=cluster.address,
                                       actors=(layout.pp or len(stages)) * layout.dp)
    else:
        per_size = measure_here(stages, samples, loss_fn=loss_fn, repeats=repeats, device=device, threads=threads,
                                autocast=autocast)
    costs = [StageCost.through([(rows, m[s]) for rows, m in zip(sizes, per_size)]) for s in range(len(per_size[0]))]
    modules = stages.modules if isinstance(stages, StageSource) else stages
    costs = [dataclasses.replace(c, expert_bytes=_expert_bytes(m)) for c, m in zip(costs, modules)]
    costs, tps, refused = _with_tp(costs, modules, config, resolve_tp)
    costs = with_exchanges(costs, modules, layout.ep, DEFAULT_LATENCY_S[device], DEFAULT_BYTES_PER_S[device])
    limit = config.planning.memory_limit_bytes if config.planning.memory_limit_bytes is not None else \
        int((total or default_memory_limit(device)) * placement.memory_fraction)  # a shared GPU's share (devices.py)
    decision = choose_schedule(costs, memory_limit_bytes=limit, batch_size=per_replica, microbatches=ms,
                               schedule_names=None if schedule == "auto" else [schedule],
                               num_ranks=layout.pp, comm_latency_s=DEFAULT_LATENCY_S[device],
                               bytes_per_s=DEFAULT_BYTES_PER_S[device],
                               # zero=1: each replica holds 1/dp of the optimizer state (Note [ZeRO-1 sharding])
                               dp=layout.dp,
                               zero=None if config.planning.choose_zero and not layout.zero else layout.zero,
                               # recompute=False (the default) lets auto turn it on when nothing else fits
                               recompute=None if config.recipe.recompute is False else config.recipe.recompute,
                               tp=tps if len(tps) > 1 else tps[0], tp_latency_s=DEFAULT_LATENCY_S[device],
                               tp_bytes_per_s=DEFAULT_BYTES_PER_S[device], ep=layout.ep,
                               overlap=False if layout.cp > 1 else layout.overlap)  # off under cp: overlap.py
    decision = dataclasses.replace(decision, skipped=decision.skipped + tuple(refused))
    log.info("%s", decision.table())
    if verbose:
        print(decision.table(), flush=True)
    return decision


def _expert_bytes(module: torch.nn.Module) -> float:
    """The bytes of ``module``'s routed experts (a factory's on meta: their shapes), all of them."""
    tensors = [t for _, block in find_moe_blocks(module) for t in (block.experts.gate_up_proj, block.experts.down_proj)]
    return float(sum(t.numel() * t.element_size() for t in tensors))


def _with_tp(costs: list[StageCost], modules: Sequence[torch.nn.Module], config: PipelineConfig,
             resolve_tp: Optional[Callable]) -> tuple[list[StageCost], tuple[int, ...], list]:
    """``costs`` with each stage's TP profile (Note [TP cost model] in tp.py), the tp choices
    a plan applies to, and ``("tp=T", 0, why)`` for those it does not."""
    tps, plans, refused = config.layout.tp_choices, None, []
    for t in sorted((t for t in tps if t > 1), reverse=True):
        try:
            plan = config.layout.tp_plan
            got = resolve_tp(modules, plan, t) if resolve_tp else [plan] * len(modules)
        except ValueError as e:
            refused.append((f"tp={t}", 0, str(e)))
            continue
        plans = plans or got
    tps = tuple(t for t in tps if t == 1 or f"tp={t}" not in {r[0] for r in refused})
    if not tps:
        raise ValueError("no tp choice applies to these stages: " + "; ".join(f"{t}: {why}" for t, _, why in refused))
    if plans is None:
        return costs, tps, refused
    out = []
    for s, (cost, module, plan) in enumerate(zip(costs, modules, plans)):
        p = tp_profile(module, plan)
        hidden = cost.in_bytes if s == len(costs) - 1 and s > 0 else cost.out_bytes  # the layers' activation
        out.append(dataclasses.replace(cost, tp_share=p.share, tp_forward=p.forward, tp_backward=p.backward,
                                       tp_bytes=hidden))
    return out, tps, refused
