"""``python -m mpmd demo | profile``: the demo model on a local Ray (the benchmarks: ``benchmarks/``).

    python -m mpmd demo
    python -m mpmd profile [--schedule interleaved-1f1b] [--actors 2] [--microbatches 4] [--steps 5] [--out DIR]
"""

from __future__ import annotations

import os
import sys


def add_parsers(sub) -> None:
    p = sub.add_parser("demo", help="train the demo model on a local Ray")
    p.set_defaults(run=_demo)

    p = sub.add_parser("profile", help="profile the demo model: summary table, Chrome trace and PNG timeline")
    p.add_argument("--schedule", default="interleaved-1f1b", help="schedule name (default: interleaved-1f1b)")
    p.add_argument("--actors", type=int, default=2, help="pipeline actors (default: 2)")
    p.add_argument("--microbatches", "-m", type=int, default=4, help="microbatches per step (default: 4)")
    p.add_argument("--steps", type=int, default=5, help="profiled steps (default: 5)")
    p.add_argument("--warmup", type=int, default=3, help="steps before profiling (default: 3)")
    p.add_argument("--fusion", default="step", choices=("step", "consecutive", "none"))
    p.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    p.add_argument("--out", default="out/profile", help="folder for trace.json and timeline.png (default: out/profile)")
    p.set_defaults(run=_profile)


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo()


def _profile(args) -> int:
    import torch

    from ..models import GPTConfig, char_dataset, gpt_stages, lm_loss
    from ..pipeline import Pipeline
    from ..runtime.devices import ensure_ray
    from .demo import demo_text

    try:
        import schedules

        per = schedules.schedule_info(args.schedule).default_stages_per_rank
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ensure_ray(args.actors)
    vocab, batches = char_dataset(demo_text(), seq_len=32, batch_size=args.batch_size, steps=1)
    num_stages = args.actors * per
    cfg = GPTConfig(vocab_size=len(vocab), seq_len=32, d_model=64, n_heads=4, n_layers=max(4, num_stages))
    stages = gpt_stages(cfg, num_stages=num_stages)
    x, y = batches[0]
    try:
        pipe = Pipeline(stages, schedule=args.schedule, num_microbatches=args.microbatches, num_actors=args.actors,
                        loss_fn=lm_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), device="cpu",
                        fusion=args.fusion)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with pipe:
        from ..profiler import profile_pipeline

        report = profile_pipeline(pipe.engine, x, y, steps=args.steps, warmup=args.warmup)
    print(report.summary())
    os.makedirs(args.out, exist_ok=True)
    trace = os.path.join(args.out, "trace.json")
    report.save_chrome_trace(trace)
    print(f"\nChrome trace: {trace} (open in https://ui.perfetto.dev or chrome://tracing)")
    png = os.path.join(args.out, "timeline.png")
    try:
        report.plot(png)
        print(f"timeline: {png}")
    except ImportError as e:
        print(f"timeline not drawn: {e}", file=sys.stderr)
    return 0
