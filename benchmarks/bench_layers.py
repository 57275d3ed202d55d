"""``python -m mpmd bench layers``: ``parallel.layers = "balanced"`` against equal layers, one run.

The config's model and pipeline (default: configs/debug.toml made into a model whose LM head
costs about three decoder layers: ``DEFAULT_SET``, overridable with ``--set``) are built twice,
with equal layers per stage and with the split the cost model balances (Note [balanced
layers] in mpmd/lm/plan.py), the second loaded with the first's weights.  Both train on the
same batches in alternating rounds; the median step times' ratio is printed next to the cost
model's predicted ratio, with the largest loss difference between them (the same model and
weights: only float rounding may differ)."""

from __future__ import annotations

import statistics
import sys

from .harness import PipelineSet, ensure_ray, print_table, time_rounds

__all__ = ["HELP", "add_arguments", "DEFAULT_SET"]

HELP = "mpmd train's parallel.layers = \"balanced\" against equal layers: step time, measured and predicted"

# A Llama of 8 layers of width 256 whose head (8192 x 256) is worth ~2.7 of them, on 2 CPU actors.
DEFAULT_SET = ("model.hidden_size=256", "model.intermediate_size=704", "model.num_layers=8", "model.num_heads=4",
               "model.vocab_size=8192", "data.seq_len=64", "optim.batch_size=32", "parallel.microbatches=4",
               "parallel.schedule=\"1f1b\"", "parallel.stages=2")


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", default="configs/debug.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value, after the bench's own (DEFAULT_SET in bench_layers.py)")
    p.add_argument("--steps", type=int, default=8, help="timed steps per round (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default: 2)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (default: 3)")
    p.set_defaults(run=_run)


def _run(args) -> int:
    import dataclasses

    import torch

    from mpmd.lm import ConfigError, load_config
    from mpmd.lm.models import layer_counts, llama_spec, stage_factories
    from mpmd.lm.plan import balanced_layers, plan_schedule
    from mpmd.lm.recipe import pipeline_options
    from mpmd.pipeline import Pipeline
    from mpmd.planning import causal_lm_loss

    try:
        cfg = load_config(args.config, [*DEFAULT_SET, "parallel.layers=\"equal\"", *args.overrides])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = cfg.parallel
    spec = llama_spec(cfg.model, cfg.model.vocab_size or cfg.tokenizer.vocab_size)
    if spec.family != "llama" or p.schedule == "auto":
        print("error: bench layers needs model.family = \"llama\" and a named parallel.schedule", file=sys.stderr)
        return 2
    balanced, before, after = balanced_layers(cfg, spec, plan_schedule(cfg))
    equal = layer_counts(spec.num_layers, p.stages)
    ensure_ray(p.stages * p.dp * p.tp * 2)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, spec.vocab_size, (cfg.optim.batch_size, cfg.data.seq_len), generator=g)
    options = pipeline_options(dataclasses.replace(p, compile=False), cfg.optim)
    warm = {}
    with PipelineSet() as pipes:
        for name, counts in (("equal", equal), ("balanced", balanced)):
            factories = stage_factories(spec, p.stages, cfg.data.seq_len, counts=counts)
            pipes[name] = Pipeline(factories, loss_fn=causal_lm_loss, **options)
        pipes["balanced"].load_state_dict(pipes["equal"].state_dict())  # the same weights (the model's own keys)
        for name, pipe in pipes.items():
            warm[name] = [pipe.step(batch, batch) for _ in range(args.warmup)]
        times, losses = time_rounds(pipes, [(batch, batch)] * args.steps, args.rounds)
    t_equal, t_balanced = (statistics.median(times[n]) for n in pipes)
    print(f"\n{spec.family}: {spec.num_layers} layers of width {spec.hidden_size}, vocab {spec.vocab_size}; "
          f"{p.stages} stages, {p.schedule}, {p.microbatches} microbatches, device {p.device}; "
          f"median of {args.steps} steps x {args.rounds} alternating rounds")
    print_table(("layers", "per stage", "median step ms", "predicted (equal = 1)"),
                [("equal", str(equal), f"{t_equal * 1e3:.1f}", "1.000"),
                 ("balanced", str(balanced), f"{t_balanced * 1e3:.1f}", f"{after / before:.3f}")])
    a, b = (warm[name] + losses[name] for name in pipes)
    print(f"balanced / equal step time: measured {t_balanced / t_equal:.3f}, predicted {after / before:.3f}; "
          f"largest loss difference: {max(abs(x - y) for x, y in zip(a, b)):.2e}")
    return 0
