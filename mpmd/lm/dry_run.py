"""``mpmd train CONFIG --dry-run``: the plan of a run without actors or weights.

The stages are built on the meta device (no memory: an 8B model's structure costs the
controller a few MB), the schedule is built and lowered as the Pipeline would and its
programs simulated (``mpmd.lm.plan.simulate_plan``), and per actor the peak memory is
estimated (Note [dry-run memory]); nothing is trained.

Note [dry-run memory]: per actor, ``16`` bytes per parameter of its stages (float32
weights, gradients and AdamW's two moments; bf16/fp16 autocast keeps float32 masters;
with ``parallel.zero = 1`` the moments are split over the dp replicas: ``8 + 8/dp``),
plus what its microbatches hold, walked over its schedule by the accounting
``schedule="auto"`` uses (``mpmd.planning.rank_memory``): a microbatch holds its stage's
activations from F to its backward's end (B, or W when the backward is split), a split
backward also the gradients W starts from (at each linear's output) from I to W, and a
recomputed stage only its input and output until its backward, which holds the recomputed
forward's activations (during B, or from I to W: Note [recompute at I]).  One microbatch's
activations per decoder layer are ``34*s*b*h`` bytes at 16-bit (Korthikanti et al. 2022,
eq. 2, without the ``5*a*s/h`` term of the attention scores, which SDPA's fused attention
does not keep; twice that at fp32); the last stage's add the float32 logits' softmax and
their gradient, ``2*4*s*b*V``.  A mixture-of-experts layer (``LlamaSpec.moe``) keeps the
attention's and the norms' ``15*s*b*h`` of the ``34`` and, for its MLP, what
``mpmd.planning.moe_layer_bytes`` counts: the router's float32 logits, per routed slot the
dispatched row, the expert's intermediate values and its output come back, the shared experts';
its routed experts' weights count ``1/ep`` on each actor (``parallel.ep``; the router and the
shared experts whole), with their full AdamW state whatever ``zero`` (each actor steps the
experts it holds), and the all-to-all send buffers (``2*s*b*top_k*h`` at 16-bit, one layer at a
time) add to each pass's peak; its FLOPs count the ``top_k`` active experts.  With ``parallel.tp = T`` each of a stage's ``T``
actors holds ``1/T`` of its matrices (the norms whole) and does ``1/T`` of its FLOPs (the TP
all-reduces are not charged); a layer's activations are sharded over the sequence or the heads
(Note [sequence parallelism] in mpmd/tensor_parallel/builtin.py) but for the inputs of attention
and the MLP, gathered whole and kept by their matmuls: ``s*b*h*(30/T + 4)`` at 16-bit (Megatron,
which gathers them again in the backward, keeps ``34/T``); the logits are sharded over the
vocabulary (``loss_parallel``: ``8*s*b*V/T``).  Step time, when a peak FLOP/s is known
(``run.peak_flops``), is the simulated makespan of the actors' programs with each stage's
forward, input- and weight-gradient at a third of its training FLOPs each over that peak: the
time at 100% MFU.  A mixture of experts (``model.family`` "qwen3_moe", "deepseek_v3"): its
experts split over ``parallel.ep`` of a stage's dp x cp actors, their optimizer state outside ZeRO-1, its
activations with the all-to-all buffers (``moe_layer_bytes``, above); its FLOPs count the
active parameters (Note [MFU] in flops.py).  With ``parallel.cp = C`` each of a stage's ``C``
actors holds one zigzag shard of ``seq_len / C`` tokens of every microbatch: its activations (the
attention's too: the ring keeps only the shard's) are the whole sequence's over ``C``, its
parameters, gradients and optimizer state whole (Note [memory at cp] in
mpmd/planning/memory.py), its FLOPs ``1/C`` of the stage's; the actors are ``stages x dp x
tp x cp``."""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import schedules

from .checks import check_pipeline
from .config import SCHEDULE_AUTO, TrainConfig
from .flops import flops_per_token
from .models import LlamaSpec, llama_spec, meta_stages, param_counts, stage_factories
from ..planning.memory import moe_layer_bytes
from .plan import (balance_hint, expert_parallel, moe_layers, plan_schedule, simulate_plan, stage_exchanges,
                   stage_layer_counts)

__all__ = ["DryRun", "dry_run", "AUTO_CANDIDATES"]

AUTO_CANDIDATES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
_GIB = 2 ** 30


@dataclasses.dataclass
class DryRun:
    cfg: TrainConfig
    spec: LlamaSpec
    layers: list  # per stage, its decoder layer indices
    params: list  # per stage
    schedule: schedules.Schedule
    bubble: float  # the busiest rank's idle share of the step
    step_time_s: Optional[float]
    memory: list  # bytes per actor (pipeline rank)
    memory_limit: Optional[float]
    seconds: float
    rss_growth: float  # bytes
    candidates: list  # (name, step time or makespan, bubble, peak memory, fits) with schedule = "auto"
    idle: float = 0.0  # the ranks' mean idle share of the step (an imbalance of the stages shows here)
    notes: list = dataclasses.field(default_factory=list)  # the layer split chosen, or a better one (plan.py)
    experts: list = dataclasses.field(default_factory=list)  # per stage, its routed experts' parameters (all EP ranks')

    @property
    def actors(self) -> int:
        p = self.cfg.parallel
        return self.schedule.num_ranks * p.dp * p.tp * p.cp

    @property
    def per_actor(self) -> list:
        """Per stage, the parameters one of its actors holds (its share of the routed experts)."""
        ep = self.cfg.parallel.ep
        return [n - e + e // ep for n, e in zip(self.params, self.experts or [0] * len(self.params))]

    @property
    def fits(self) -> Optional[bool]:
        return None if self.memory_limit is None else max(self.memory) <= self.memory_limit

    def text(self) -> str:
        c, s = self.cfg, self.spec
        moe = s.moe is not None
        out = [f"model: {s.family} {c.model.size}: {sum(self.params):,} parameters, {s.num_layers} layers, hidden "
               f"{s.hidden_size}, vocab {s.vocab_size}; {flops_per_token(s, c.data.seq_len, causal=True):.4g} "
               f"FLOPs/token (causal attention) "
               f"at seq_len {c.data.seq_len}{' (active parameters)' if moe else ''}", "",
               "stage  layers        parameters" + ("  routed experts  per actor (experts / ep)" if moe else "")]
        for i, (layers, n) in enumerate(zip(self.layers, self.params)):
            extra = (" + embeddings" if i == 0 else "") + (" + norm, head" if i == len(self.params) - 1 else "")
            span = f"{layers[0]}-{layers[-1]}" if layers else "-"
            mine = f"  {self.experts[i]:>14,}  {self.per_actor[i]:>14,}" if moe else ""
            out.append(f"{i:>5}  {span:<12}  {n:>14,}{mine}{extra}")
        out += ["", f"schedule {self.schedule.name}: {self.schedule.num_ranks} ranks x {c.parallel.microbatches} "
                f"microbatches, dp {c.parallel.dp}" + (f", cp {c.parallel.cp} (each actor holds "
                f"{c.data.seq_len // c.parallel.cp:,} of each sequence's {c.data.seq_len:,} tokens)"
                if c.parallel.cp > 1 else ""),
                self.schedule.render(), ""]
        if self.candidates:
            out.append("auto (simulated; the run decides again from measured costs):")
            out += [f"  {n:<18} {t:.4g}  bubble {b:.1%}  peak {m / _GIB:.2f} GiB{'' if f else '  (too big)'}"
                    for n, t, b, m, f in self.candidates]
            out.append("")
        out += self.notes
        out.append(f"predicted bubble: {max(0.0, self.bubble):.1%} (the ranks idle {max(0.0, self.idle):.1%} of the "
                   f"step on average)" + (
            f"; step time at peak FLOP/s (MFU 100%): {self.step_time_s:.3g} s" if self.step_time_s else
            " (set run.peak_flops for a step time)"))
        out.append("peak memory per actor (Note [dry-run memory]): " +
                   ", ".join(f"rank {r}: {m / _GIB:.2f} GiB" for r, m in enumerate(self.memory)))
        if s.moe is not None:
            out.append(self._experts_line())
        device = "GPUs" if c.parallel.device == "cuda" else "CPU actors"
        limit = ("no memory limit set (parallel.memory_limit_gb)" if self.memory_limit is None else
                 f"{'fits' if self.fits else 'does NOT fit'} memory_limit_gb = {self.memory_limit / _GIB:g}")
        p = c.parallel
        grid = (f": {self.schedule.num_ranks} pipeline ranks x dp {p.dp}" + (f" x tp {p.tp}" if p.tp > 1 else "")
                + (f" x cp {p.cp}" if p.cp > 1 else "") + (f", the experts over EP groups of {p.ep} {'replicas' if p.cp == 1 else 'actors'}"
                                                           if p.ep > 1 else "") if p.ep > 1 or p.cp > 1 else "")
        out.append(f"actors: {self.actors} ({device}{grid}); {limit}")
        out.append(f"dry run: {self.seconds:.1f} s, controller RSS +{self.rss_growth / 2 ** 20:.0f} MB")
        return "\n".join(out)


    def _experts_line(self) -> str:
        """What the experts cost each actor (Note [dry-run memory]: ``moe_layer_bytes``)."""
        c, moe, p = self.cfg, self.spec.moe, self.cfg.parallel
        ep = expert_parallel(c)
        tokens = c.optim.batch_size // (p.microbatches * p.dp) * c.data.seq_len // p.cp  # one CP shard's
        layer = moe_layer_bytes(moe, hidden_size=self.spec.hidden_size, tokens=tokens, ep=ep, dp=p.dp, zero=p.zero,
                                element_bytes=4.0 if p.precision == "fp32" else 2.0)
        counts = [len(x) for x in self.layers]
        most = max(moe_layers(self.spec, counts, s) for s in range(len(counts)))
        shared = f" + {moe.num_shared_experts} shared" if moe.num_shared_experts else ""
        return (f"experts: {moe.num_experts} routed{shared} per MoE layer (top {moe.top_k}; the first "
                f"{moe.first_dense_layers} layers dense), split over ep={ep}: an actor holds {moe.num_experts // ep} per "
                f"layer, {layer.expert_params:,} parameters, {layer.state_bytes / _GIB:.2f} GiB with their gradients "
                f"and optimizer state (up to {most} MoE layers a stage: {most * layer.state_bytes / _GIB:.2f} GiB); "
                f"all-to-all buffers {layer.a2a_bytes / _GIB:.3f} GiB in flight per microbatch")


def _rss() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def dry_run(cfg: TrainConfig) -> DryRun:
    check_pipeline(cfg)  # what the run would refuse, refused here too
    t0, rss0 = time.perf_counter(), _rss()
    vocab = cfg.model.vocab_size or _tokenizer_vocab(cfg)
    spec = llama_spec(cfg.model, vocab)
    p = cfg.parallel
    notes: list[str] = []
    counts = stage_layer_counts(cfg, spec, notes.append) if spec.family != "gpt" else None
    hint = balance_hint(cfg, spec)
    notes += [hint] if hint else []
    factories = stage_factories(spec, p.stages, cfg.data.seq_len, counts=counts)
    stages = meta_stages(factories)
    params = param_counts(stages)
    layers = [list(getattr(s, "layer_indices", ())) for s in stages]
    limit = p.memory_limit_gb * _GIB if p.memory_limit_gb else None
    candidates = []
    counts = [len(x) for x in layers]
    experts = spec.moe is not None and p.ep > 1
    names = [*AUTO_CANDIDATES, *(["dualpipev"] if experts else [])] if p.schedule == SCHEDULE_AUTO else [p.schedule]
    plans = []
    for name in names:
        # "auto" at ep > 1: a schedule with pairs both ways, as schedule="auto" weighs them (docs/overlap.md)
        both = p.schedule == SCHEDULE_AUTO and experts and p.overlap == "auto" and p.cp == 1 and _paired(name)
        for overlap in (False, True) if both else (None,):
            try:
                sched = plan_schedule(cfg, name, overlap)
            except ValueError as e:
                if p.schedule != SCHEDULE_AUTO:
                    raise ValueError(f"parallel: {e}") from None
                continue
            label = name + ("+overlap" if _overlapped(sched) and p.schedule == SCHEDULE_AUTO else "")
            plans.append((label, sched) + simulate_plan(cfg, spec, sched, params, counts))
    if not plans:
        raise ValueError(f"schedule = \"auto\": none of {', '.join(AUTO_CANDIDATES)} can place {p.stages} stages")
    if p.schedule == SCHEDULE_AUTO:
        candidates = [(n, t or r.makespan, r.bubble_fraction, max(m), limit is None or max(m) <= limit)
                      for n, _, r, t, m in plans]
        fitting = [x for x in plans if limit is None or max(x[4]) <= limit] or plans
        plans = [min(fitting, key=lambda x: x[3] or x[2].makespan)]
    name, sched, result, step_time, memory = plans[0]
    if step_time and p.step_timeout_s and step_time > p.step_timeout_s:  # Note [train's step timeout]
        notes.append(f"the predicted step, {step_time:.3g} s at peak FLOP/s (its least), is longer than "
                     f"parallel.step_timeout_s = {p.step_timeout_s:g} s: every step would time out; raise "
                     f"parallel.step_timeout_s (0: no limit)")
    if experts:
        notes.append(_exchanges_line(cfg, spec, name.split("+")[0], sched, params, counts, result, step_time))
    return DryRun(cfg, spec, layers, params, sched, result.bubble_fraction, step_time, memory, limit,
                  time.perf_counter() - t0, max(0.0, _rss() - rss0), candidates,
                  sum(result.idle) / len(result.idle) / result.makespan if result.makespan else 0.0, notes,
                  [moe_layers(spec, [len(x) for x in layers], s) * spec.moe.expert_params(spec.hidden_size)
                   if spec.moe else 0 for s in range(len(layers))])


def _paired(name: str) -> bool:
    """Whether the schedule ``name`` has forward-backward pairs to overlap (docs/overlap.md)."""
    return schedules.schedule_info(name).overlapped is not None


def _overlapped(sched: schedules.Schedule) -> bool:
    return any(a.kind is schedules.Kind.OVERLAP for acts in sched.ranks for a in acts)


def _exchanges_line(cfg: TrainConfig, spec: LlamaSpec, name: str, sched: schedules.Schedule, params: list,
                    counts: list, result, step_time: Optional[float]) -> str:
    """The experts' all-to-all per step on the busiest rank (Note [all-to-all estimate] in
    mpmd/planning/a2a.py) and, at the peak FLOP/s, what the overlap hides and buys (docs/overlap.md)."""
    p, m = cfg.parallel, cfg.parallel.microbatches
    per_mb = stage_exchanges(cfg, spec, counts)
    total = max(m * sum(sum(per_mb[s]) for s in sched.stages_of(r)) for r in range(sched.num_ranks))
    link = "GPU" if p.device == "cuda" else "CPU"
    head = (f"all-to-all (ep={p.ep}, an assumed {link} link: Note [all-to-all estimate]): {total:.3g} s per step on "
            f"the busiest rank")
    if not step_time:
        return head + "; set run.peak_flops to weigh it against compute and see what the overlap hides"
    if not _paired(name):
        return head + f"; {name} has no forward-backward pairs to overlap it (dualpipev has)"
    if p.cp > 1:  # mpmd/runtime/overlap.py: one shard context per actor
        return head + f"; not overlapped under parallel.cp = {p.cp}"
    other, overlapped = plan_schedule(cfg, name, not _overlapped(sched)), _overlapped(sched)
    other_result, other_time, _ = simulate_plan(cfg, spec, other, params, counts)
    on, off = (step_time, other_time) if overlapped else (other_time, step_time)
    hidden = max((result if overlapped else other_result).all_to_all_hidden, default=0.0)
    use = "" if overlapped else "; not used: set parallel.overlap = true (or \"auto\") to use it"
    return head + (f"; {name} with its pairs overlapped hides {hidden:.3g} s of it behind compute: step {on:.3g} s "
                   f"against {off:.3g} s without ({(off - on) / off:.1%} saved{use})")


def _tokenizer_vocab(cfg: TrainConfig) -> int:
    if cfg.tokenizer.path is None:
        return cfg.tokenizer.vocab_size
    from .data import load_tokenizer

    return load_tokenizer(cfg.tokenizer.path).get_vocab_size()
