"""``python -m mpmd demo | profile | bench``: commands that start actors on a local Ray.

    python -m mpmd demo
    python -m mpmd profile [--schedule interleaved-1f1b] [--actors 2] [--microbatches 4] [--steps 5] [--out DIR]
    python -m mpmd bench [--schedule 1f1b,interleaved-1f1b] [--actors 2] [--microbatches 8] [--steps 8]
    python -m mpmd bench --predict [--schedule 1f1b,zbv] ...   (measured vs predicted step time and bubble)
    python -m mpmd bench --auto [--measure-all 6] [--stages 4]  (schedule='auto': chosen, rejected, measured)
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

    p = sub.add_parser("bench", help="step time and dispatch against one process and torch.distributed.pipelining")
    p.add_argument("--schedule", default="1f1b,interleaved-1f1b",
                   help="comma-separated schedules (default: 1f1b,interleaved-1f1b)")
    p.add_argument("--actors", type=int, default=2, help="pipeline processes (default: 2)")
    p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default: 8)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per row; the median is shown (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default: 2)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32)")
    p.add_argument("--d-model", type=int, default=128, help="GPT width (default: 128)")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (default: 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--dispatch-microbatches", default="8,32,128",
                   help="microbatch counts of the dispatch table; '' skips it (default: 8,32,128)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed.pipelining rows")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the single process and the actors on the GPU (actors share it: num_gpus=1/actors)")
    p.add_argument("--rounds", type=int, default=4,
                   help="alternating rounds of torch and the fit loop, for the paired vs-torch ratio (default: 4)")
    p.add_argument("--predict", action="store_true",
                   help="only the prediction report: measured step time and bubble against the old and the "
                        "calibrated cost model, per schedule")
    p.add_argument("--auto", action="store_true",
                   help="only the auto report: what schedule='auto' chose on --actors actors for the bench GPT in "
                        "--stages stages, by the controller-only and the calibrated prediction")
    p.add_argument("--stages", type=int, default=4, help="stages of the bench GPT for --auto (default: 4)")
    p.add_argument("--measure-all", type=int, default=0, metavar="N",
                   help="with --auto: also run the N best-predicted options (and auto's choice) and measure them")
    p.set_defaults(run=_bench)


def _demo(args) -> int:
    from .demo import run_demo

    return run_demo()


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def _profile(args) -> int:
    import torch

    from ..models import GPTConfig, char_dataset, gpt_stages, lm_loss
    from ..pipeline import Pipeline
    from .bench import ensure_ray
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


def _bench(args) -> int:
    from .bench import BenchConfig, run_bench

    try:
        cfg = BenchConfig(schedules=tuple(s.strip() for s in args.schedule.split(",") if s.strip()),
                          actors=args.actors, microbatches=args.microbatches, steps=args.steps, warmup=args.warmup,
                          batch_size=args.batch_size, d_model=args.d_model, n_layers=args.layers,
                          seq_len=args.seq_len, dispatch_microbatches=_ints(args.dispatch_microbatches),
                          torch_pipelining=not args.no_torch, rounds=args.rounds, device=args.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"mpmd bench: {', '.join(cfg.schedules)} on {cfg.actors} processes (progress on stderr)")
    progress = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.auto:
        from .bench_auto import run_auto

        run_auto(cfg, measure_all=args.measure_all, stages_count=args.stages, log=print, progress=progress)
        return 0
    if args.predict:
        from .bench_predict import run_predict

        run_predict(cfg, log=print, progress=progress)
        return 0
    run_bench(cfg, log=print, progress=progress)
    return 0
