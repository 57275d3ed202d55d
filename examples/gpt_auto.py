"""A heterogeneous GPT cut by measured time and trained with ``schedule="auto"``.

The model is one ``nn.Sequential`` of layers from ``mpmd.models``: a token embedding,
``--blocks`` transformer blocks and a wide output head (``--vocab`` logits per token,
the most expensive layer).  ``mpmd.split(..., balance="time")`` times every layer on a
sample microbatch and cuts where the slowest stage is fastest; ``schedule="auto"``
simulates every registered schedule and microbatch count and takes the fastest that
fits in memory.

    python examples/gpt_auto.py                  # split by time, auto schedule, train
    python examples/gpt_auto.py --compare        # also: step time of a uniform split vs
                                                 # balance="time", predicted vs measured stages
    python examples/gpt_auto.py --compare --train-steps 0    # only the comparison
    python examples/gpt_auto.py --measure-all 6  # also run auto's 6 best options side by side:
                                                 # is its choice the fastest measured? (its choice
                                                 # runs twice: the harness's own noise floor)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics

import ray
import torch
from torch import nn

import mpmd
import schedules
from benchmarks.bench_auto import auto_report, measure_options
from mpmd.cli.demo import demo_text
from mpmd.models import Block, Embedding, GPTConfig, Head, char_dataset, lm_loss


def build_model(cfg: GPTConfig, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(Embedding(cfg), *[Block(cfg) for _ in range(cfg.n_layers)], Head(cfg))


def adamw(params):
    return torch.optim.AdamW(params, lr=3e-3)


def stage_times(reports, num_stages: int, stat=statistics.median) -> list[float]:
    """Per stage, the measured F plus the backward (B, or I + W) of one microbatch, from the
    actors' timelines: medians by default (a busy machine preempts some tasks); ``stat=
    statistics.fmean`` gives the means, what auto's calibration charges (a step pays the tail too)."""
    spans: dict[tuple[int, str], list[float]] = {}
    for r in reports:
        for sl in r.slices:
            if sl.kind in ("F", "B", "I", "W"):
                spans.setdefault((schedules.Action.parse(sl.name).stage, sl.kind), []).append(sl.seconds)
    med = lambda s, kind: stat(spans.get((s, kind), [0.0]))  # noqa: E731
    return [med(s, "F") + med(s, "B") + med(s, "I") + med(s, "W") for s in range(num_stages)]


def compare(cfg: GPTConfig, batches, args) -> None:
    """Uniform (equal layer counts) and balance='params' vs balance='time' on one schedule;
    the split's predicted per-stage time against the measured one."""
    m = args.microbatches
    if not ray.is_initialized():  # one local Ray for every pipeline below
        ray.init(num_cpus=max(os.cpu_count() or 1, 3 * args.actors), include_dashboard=False,
                 log_to_driver=False)
    rows = batches[0][0].shape[0] // m
    sample = (batches[0][0][:rows], batches[0][1][:rows])  # one microbatch; the head's time includes the loss
    k, n_layers = args.compare_stages, cfg.n_layers + 2
    uniform = [n_layers // k + (i < n_layers % k) for i in range(k)]
    timed = mpmd.split(build_model(cfg), num_stages=k, balance="time", sample=sample, loss_fn=lm_loss)
    splits = {"uniform": mpmd.split(build_model(cfg), balance=uniform, verbose=False),
              "params": mpmd.split(build_model(cfg), num_stages=k, balance="params", verbose=False),
              "time": timed}
    print(f"\n{k} stages, {args.compare_schedule}, m={m}, {args.actors} actors, {args.steps} profiled steps "
          f"per run, {args.repeats} runs; medians")
    # All three pipelines live at once (idle actors cost no CPU) and take turns, so a change
    # in the machine's load hits each split alike.
    pipes = {name: mpmd.Pipeline(stages, schedule=args.compare_schedule, num_microbatches=m,
                                 num_actors=args.actors, loss_fn=lm_loss, optimizer=adamw, device="cpu")
             for name, stages in splits.items()}
    reports: dict[str, list] = {name: [] for name in splits}
    order, rng = list(pipes), random.Random(0)
    try:
        for _ in range(args.repeats):
            rng.shuffle(order)  # no split always runs first after another's turn
            for name in order:
                reports[name].append(pipes[name].profile(*batches[0], steps=args.steps))
    finally:
        for pipe in pipes.values():
            pipe.shutdown()
    results = {}
    for name, stages in splits.items():
        rs = reports[name]
        step = statistics.median(t for r in rs for t in r.step_seconds_each)
        per_stage = stage_times(rs, k)
        results[name] = (stages.layer_counts, step, per_stage)
    print(f"{'split':<8} {'layers per stage':<18} {'step ms':>9}  {'vs time':>7}  measured f+b per stage (ms)")
    for name, (counts, step, per_stage) in results.items():
        ratio = step / results["time"][1]
        print(f"{name:<8} {str(counts):<18} {step * 1e3:>9.2f}  {ratio:>6.2f}x  "
              + " ".join(f"{t * 1e3:7.3f}" for t in per_stage))
    pred = timed.predicted_s
    meas = results["time"][2]
    print("balance='time' per stage: predicted (split, controller) vs measured (actors), ms per microbatch")
    for s, (p, q) in enumerate(zip(pred, meas)):
        print(f"  stage {s}: predicted {p * 1e3:7.3f}  measured {q * 1e3:7.3f}  ratio {q / p:5.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192, help="output head width (logits per token)")
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--actors", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=30, help="0: only --compare")
    ap.add_argument("--memory-limit-mib", type=float, default=None)
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--compare-stages", type=int, default=2)
    ap.add_argument("--compare-schedule", default="1f1b")
    ap.add_argument("--microbatches", type=int, default=4, help="for --compare")
    ap.add_argument("--steps", type=int, default=5, help="profiled steps per --compare run")
    ap.add_argument("--repeats", type=int, default=3, help="runs per split in --compare (median)")
    ap.add_argument("--measure-all", type=int, default=0, metavar="N",
                    help="measure auto's N best-predicted options (and its choice) side by side")
    args = ap.parse_args()

    text = demo_text()
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=4,
                    n_layers=args.blocks)
    vocab, batches = char_dataset(text, seq_len=args.seq_len, batch_size=args.batch,
                                  steps=max(args.train_steps, 1))
    assert len(vocab) <= args.vocab, "the head must cover the text's characters"
    model = build_model(cfg)
    print(f"GPT: embedding, {args.blocks} blocks, head over {args.vocab} tokens; "
          f"{sum(p.numel() for p in model.parameters()):,} parameters")

    if args.train_steps == 0:
        compare(cfg, batches, args)
        return 0
    if args.measure_all and not ray.is_initialized():  # logical CPUs for every measured option's actors at once
        ray.init(num_cpus=2 * args.actors * (args.measure_all + 3), include_dashboard=False, log_to_driver=False)
    rows = args.batch // 4
    sample = (batches[0][0][:rows], batches[0][1][:rows])  # one microbatch; the head's time includes the loss
    stages = mpmd.split(model, num_stages=args.stages, balance="time", sample=sample, loss_fn=lm_loss)
    limit = int(args.memory_limit_mib * 2**20) if args.memory_limit_mib else None
    with mpmd.Pipeline(stages, schedule="auto", num_microbatches="auto", sample=batches[0], loss_fn=lm_loss,
                       optimizer=adamw, num_actors=args.actors, device="cpu", memory_limit_bytes=limit) as pipe:
        history = pipe.fit(batches)
        report = pipe.profile(*batches[0], steps=5)
    first, last = statistics.fmean(history[:5]), statistics.fmean(history[-5:])
    d = pipe.auto_decision
    print(f"loss {first:.3f} -> {last:.3f}; {d.schedule} m={d.num_microbatches}: predicted "
          f"{d.predicted_step_s * 1e3:.1f} ms per step, measured {report.step_seconds * 1e3:.1f} ms")
    split = any(sl.kind == "I" for sl in report.slices)
    measured = stage_times([report], len(d.stage_costs), statistics.fmean)
    print("per stage, forward + backward of one microbatch (means over 5 profiled steps): predicted by auto (the "
          "controller's timing corrected by its trials on the actors) vs measured now")
    for s, (c, t) in enumerate(zip(d.stage_costs, measured)):
        p = c.f + (c.b + c.w if split else c.full)
        print(f"  stage {s}: predicted {p * 1e3:8.3f} ms  measured {t * 1e3:8.3f} ms  ratio {t / p:5.2f}")
    if args.measure_all:
        fitting = [o for o in d.options if o.fits][:args.measure_all]
        measured = measure_options(stages, batches, fitting + [d.chosen] + [d.provisional.chosen] * bool(d.provisional),
                                   loss_fn=lm_loss, optimizer=adamw, device="cpu", duplicate=d.chosen)
        print("\n".join(auto_report(d, measured)))
    if args.compare:
        compare(cfg, batches, args)
    return 0 if last < first else 1


if __name__ == "__main__":
    raise SystemExit(main())
