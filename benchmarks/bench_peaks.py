"""``python -m mpmd bench peaks``: the memory model against what the actors hold, per actor.

For each model shape (``debug``: mpmd train's debug Llama; ``125m``: a 125M-shaped Llama
scaled to fit 2 cores), schedule (1F1B, interleaved 1F1B, ZB-H1, ZB-V, DualPipeV) and
recompute off and on: the prediction is ``schedule="auto"``'s, stage costs measured on the
controller (``plan_pipeline``) walked over each actor's schedule (``rank_memory``: the
accounting the dry run shares); the measurement is a pipeline of that plan, AdamW, two
steps, each actor's peak resident size during the second above its resident size before it
(the kernel's VmHWM, restarted after the heap is trimmed), plus the parameter and optimizer
bytes it held before the step.  (The gradients are not held between steps: every update
sets them to None, so the step's growth counts them where they are allocated.)  ``dynamic`` compares only what the step adds
(gradients and activations), ``total`` everything.

The actors run with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB when this bench starts Ray:
every tensor larger than that is its own mapping, returned when freed, so the resident size
follows what is alive instead of what the heap kept from earlier steps.
"""

from __future__ import annotations

import statistics

import torch

from mpmd.pipeline import Pipeline
from mpmd.planning import causal_lm_loss, plan_pipeline, rank_memory, split
from mpmd.runtime import PipelineConfig, build_schedule
from .harness import ensure_ray, print_table, progress, step_memory

__all__ = ["HELP", "add_arguments", "run", "SHAPES", "SCHEDULES"]

HELP = "predicted against measured peak memory per actor, per schedule, with and without recompute"

# name -> (hidden, layers, heads, kv heads, vocab, seq, batch)
SHAPES = {"debug": (64, 4, 4, 2, 512, 256, 32), "125m": (384, 4, 6, 2, 8192, 256, 16)}
SCHEDULES = {"1f1b": 2, "interleaved-1f1b": 4, "zb-h1": 2, "zbv": 4, "dualpipev": 4}  # name -> stages (2 actors)


def add_arguments(p) -> None:
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--microbatches", type=int, default=4)
    p.set_defaults(run=run)


def run(args) -> int:
    ensure_ray(2, env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    rows, ratios = [], []
    for shape in args.shapes:
        for name in args.schedules:
            for recompute in (False, True):
                progress(f"bench peaks: {shape} {name} recompute={recompute}")
                for rank, (predicted, measured, dynamic) in enumerate(compare(shape, name, recompute,
                                                                             args.microbatches)):
                    ratios.append(measured / predicted)
                    rows.append([shape, name, "on" if recompute else "off", str(rank), _mib(predicted),
                                 _mib(measured), f"{measured / predicted:.2f}", f"{dynamic[1] / dynamic[0]:.2f}"])
    print_table(["shape", "schedule", "recompute", "actor", "predicted MiB", "measured MiB", "total ratio",
                 "dynamic ratio"], rows)
    print(f"measured / predicted per actor: median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-"
          f"{max(ratios):.2f}; within 15%: {sum(abs(r - 1) <= 0.15 for r in ratios)} of {len(ratios)}")
    return 0


def compare(shape: str, name: str, recompute: bool, microbatches: int) -> list[tuple[float, float, tuple]]:
    """Per actor: (predicted bytes, measured bytes, (predicted, measured) of what the step adds)."""
    stages, sample = _model(shape, SCHEDULES[name])
    config = PipelineConfig.from_options(num_actors=2, device="cpu", recompute=recompute)
    decision = plan_pipeline(stages, name, config, sample, causal_lm_loss, repeats=1, verbose=False, away=False,
                             num_microbatches=microbatches)
    schedule = build_schedule(name, len(stages), config, microbatches)
    predicted = rank_memory(schedule, list(decision.stage_costs), optimizer_state_factor=2.0)
    with Pipeline(stages, schedule=name, num_microbatches=microbatches, num_actors=2, loss_fn=causal_lm_loss,
                  optimizer=_adamw, device="cpu", recompute=recompute) as pipe:
        pipe.step(*sample)  # the optimizer state exists
        before, after = step_memory(pipe, *sample)
    out = []
    for p, b, a, costs in zip(predicted, before, after, _rank_costs(schedule, decision.stage_costs)):
        held = b["params_bytes"] + b["optimizer_bytes"]  # the gradients are None between steps
        grown = a["peak_rss_bytes"] - b["rss_bytes"]
        static = costs * 3.0  # parameters and AdamW's two moments, as the model counts them
        out.append((p, held + grown, (p - static, grown)))
    return out


def _rank_costs(schedule, stage_costs) -> list[float]:
    return [sum(stage_costs[s].param_bytes for s in schedule.stages_of(r)) for r in range(schedule.num_ranks)]


def _model(shape: str, num_stages: int):
    import transformers

    hidden, layers, heads, kv, vocab, seq, batch = SHAPES[shape]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                                      max_position_embeddings=seq, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    stages = split(model, num_stages=num_stages, verbose=False)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    return list(stages), (ids, ids)


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-4)


def _mib(n: float) -> str:
    return f"{n / 2 ** 20:.1f}"
