"""``python -m mpmd bench compile``: ``mpmd train``'s ``parallel.compile`` against eager, one run.

The same config (default: configs/debug.toml's model and pipeline) is trained as two
pipelines on the same batches, eager and with each decoder layer compiled on the actors;
after ``--warmup`` steps (the compile happens in the first) the median of ``--steps`` step
times is taken, alternating the two in ``--rounds`` rounds, and the ratio printed with the
largest loss difference between them."""

from __future__ import annotations

import statistics
import sys
import time

from .harness import PipelineSet, ensure_ray, print_table, time_rounds

__all__ = ["HELP", "add_arguments"]

HELP = "mpmd train's parallel.compile against eager: step time ratio"


def add_arguments(p) -> None:
    p.add_argument("config", nargs="?", default="configs/debug.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default: inductor)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per round (default: 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, the compile among them (default: 3)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (default: 2)")
    p.set_defaults(run=_run)


def _run(args) -> int:
    import dataclasses

    import torch

    from mpmd.lm import ConfigError, load_config
    from mpmd.lm.models import llama_spec, stage_factories
    from mpmd.lm.plan import stage_layer_counts
    from mpmd.lm.recipe import pipeline_options
    from mpmd.pipeline import Pipeline
    from mpmd.planning import causal_lm_loss

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    p = cfg.parallel
    ensure_ray(p.stages * p.dp * 2)
    vocab = cfg.model.vocab_size or cfg.tokenizer.vocab_size
    spec = llama_spec(cfg.model, vocab)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, vocab, (cfg.optim.batch_size, cfg.data.seq_len), generator=g)
    options = pipeline_options(dataclasses.replace(p, compile=False), cfg.optim)
    warm = {}
    counts = stage_layer_counts(cfg, spec) if spec.family == "llama" else None  # the run's (Note [balanced layers])
    with PipelineSet() as pipes:
        for name, compiled in (("eager", False), (f"compiled ({args.backend})", True)):
            factories = stage_factories(spec, p.stages, cfg.data.seq_len, compile=compiled, backend=args.backend,
                                        counts=counts)
            pipes[name] = Pipeline(factories, loss_fn=causal_lm_loss, **options)
        for name, pipe in pipes.items():
            t0 = time.perf_counter()
            warm[name] = [pipe.step(batch, batch) for _ in range(args.warmup)]
            print(f"{name}: {args.warmup} warm-up steps in {time.perf_counter() - t0:.1f} s", flush=True)
        times, losses = time_rounds(pipes, [(batch, batch)] * args.steps, args.rounds)
    eager, compiled = (statistics.median(times[n]) for n in pipes)
    tokens = cfg.optim.batch_size * cfg.data.seq_len
    print(f"\n{spec.family} {cfg.model.size}, {p.stages} stages, {p.schedule}, {p.microbatches} microbatches, "
          f"{tokens} tokens/step, device {p.device}")
    print_table(("", "median step ms", "tokens/s"),
                [(name, f"{t * 1e3:.1f}", f"{tokens / t:.0f}") for name, t in zip(pipes, (eager, compiled))])
    a, b = (warm[name] + losses[name] for name in pipes)
    print(f"compiled / eager step time: {compiled / eager:.3f}; largest loss difference: "
          f"{max(abs(x - y) for x, y in zip(a, b)):.2e}")
    return 0
