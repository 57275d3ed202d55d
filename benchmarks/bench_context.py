"""``python -m mpmd bench context``: one long sequence on a GPT pipeline (pp=2, one microbatch
of ``--batch`` sequences of ``--seq`` tokens), run four ways in one run: the plain pipeline
(1F1B, cp=1, the GPT's own attention, which keeps the ``S x S`` probabilities), TeraPipe's
token slices (cp=1, ``--slices`` uniform slices), the plain pipeline at cp=1 with the tiled
attention the ring uses (``document_mask=True`` with one document per row: the same kernel as
cp=2 on one shard, so the memory comparison with cp=2 is of the sharding alone), and cp=2
(ring attention over two actors per stage).  TeraPipe with cp=2 is refused by the runtime; the
table says so, with the reason.

Per configuration: each actor's peak activation memory, the kernel's VmHWM during a step
above its resident size before it (the heap trimmed and the peak restarted just before; the
actors run with glibc's ``MALLOC_MMAP_THRESHOLD_`` at 64 KiB, so a freed tensor's pages go
back), the median over rounds; the step time, median over alternating rounds (Note
[alternating rounds] in harness.py); and the simulator's prediction beside it: the calibrated
cost model fitted on profiled steps of the same actors and simulated on the pipeline's program
(``ProfileReport.calibrated_step_seconds``, as ``bench predict``).  Ratios are against the
plain pipeline; the memory target (docs/context.md) compares cp=2 with the tiled cp=1, rank by
rank: the largest CP rank's peak over the cp=1 actor's.  Last, the causal attention work per CP
rank (``causal_pairs_per_rank``), zigzag against contiguous shards, largest over the mean.
"""

from __future__ import annotations

import random
import statistics
from typing import Optional

import torch

import mpmd
from actors.context import causal_pairs_per_rank, contiguous_indices, zigzag_indices
from mpmd.models import GPTConfig, gpt_stages, lm_loss
from mpmd.profiler import profile_pipeline
from .harness import PipelineSet, ensure_ray, print_table, progress, step_memory, timed

__all__ = ["HELP", "add_arguments", "run", "CONFIGS", "step_peaks", "balance_rows"]

HELP = "per-actor peak activation memory and step time of one long sequence: pipeline, TeraPipe, cp=2 (predicted too)"

PLAIN, TERAPIPE, TILED, CP2 = "1f1b cp=1", "terapipe cp=1", "1f1b cp=1 tiled", "1f1b cp=2"
CONFIGS = {  # name -> Pipeline options (besides the model, loss, optimizer, pp=2, one microbatch)
    PLAIN: dict(schedule="1f1b"),
    TERAPIPE: dict(schedule="terapipe"),
    TILED: dict(schedule="1f1b", document_mask=True),
    CP2: dict(schedule="1f1b", cp=2),
}
REFUSED = ("terapipe cp=2", dict(schedule="terapipe", cp=2))


def add_arguments(p) -> None:
    p.add_argument("--seq", type=int, default=4096, help="tokens per sequence (divisible by 8 and by --slices)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the one microbatch")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=4, help="GPT blocks, over 2 stages")
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--slices", type=int, default=4, help="TeraPipe's token slices (uniform)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profiled", type=int, default=2, help="profiled steps per configuration for the prediction")
    p.add_argument("--skip", nargs="*", default=[], choices=list(CONFIGS),
                   help="configurations not to run (e.g. the plain pipeline at long sequences: S x S memory)")
    p.set_defaults(run=run)


def step_peaks(pipe, *args, **side) -> list[int]:
    """Each actor's peak resident bytes during one step above its resident size just before it
    (heap trimmed, peak restarted: ``memory_stats(reset=True)``): what the step allocated."""
    before, after = step_memory(pipe, *args, **side)
    return [a["peak_rss_bytes"] - b["rss_bytes"] for a, b in zip(after, before)]


def balance_rows(seq: int, cps=(2, 4, 8)) -> list[list[str]]:
    """Causal (query, key) pairs per CP rank, largest over the mean, zigzag and contiguous."""
    rows = []
    for cp in cps:
        if seq % (2 * cp) == 0:
            ratio = [max(w) / statistics.mean(w) for w in (causal_pairs_per_rank(seq, cp, zigzag_indices),
                                                        causal_pairs_per_rank(seq, cp, contiguous_indices))]
            rows.append([str(cp), f"{ratio[0]:.3f}", f"{ratio[1]:.3f}"])
    return rows


def run(args) -> int:
    if args.seq % 8 or args.seq % args.slices:
        raise SystemExit(f"bench context: --seq {args.seq} must be divisible by 8 (zigzag over cp=2 ... 4) and by "
                         f"--slices {args.slices}")
    configs = {k: v for k, v in CONFIGS.items() if k not in args.skip}
    ensure_ray(sum(2 * v.get("cp", 1) for v in configs.values()), env={"MALLOC_MMAP_THRESHOLD_": "65536"})
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g) for _ in range(2))
    sides = {k: ({"position_ids": torch.arange(args.seq).expand(args.batch, -1)} if v.get("document_mask") else {})
             for k, v in configs.items()}
    refused = _refused(cfg, args)
    peaks: dict = {k: [] for k in configs}  # per round, per actor
    times: dict = {k: [] for k in configs}
    predicted: dict = {}
    with PipelineSet() as pipes:
        for key, options in configs.items():
            progress(f"bench context: starting {key}")
            pipes[key] = _pipeline(cfg, args, options)
            pipes[key].step(x, y, **sides[key])  # warm: shapes learnt, groups and buffers made
        order, shuffle = list(configs), random.Random(0)
        for r in range(args.rounds):
            progress(f"  round {r + 1}/{args.rounds}")
            shuffle.shuffle(order)
            for key in order:  # the first step of a turn is the measured one (back from another turn)
                peaks[key].append(step_peaks(pipes[key], x, y, **sides[key]))
                times[key] += [timed(pipes[key].step, x, y, **sides[key]) for _ in range(args.steps)]
        for key in configs:
            progress(f"  profiling {key}")
            report = profile_pipeline(pipes[key].engine, x, y, steps=args.profiled, warmup=0, side=sides[key] or None)
            predicted[key] = report.calibrated_step_seconds
    _print(args, configs, peaks, times, predicted, refused)
    return 0


def _pipeline(cfg: GPTConfig, args, options: dict):
    extra = {"token_slices": args.slices} if options["schedule"] == "terapipe" else {}
    return mpmd.Pipeline(gpt_stages(cfg, 2), num_actors=2, num_microbatches=1, loss_fn=lm_loss, device="cpu",
                         optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), **options, **extra)


def _refused(cfg: GPTConfig, args) -> Optional[str]:
    """Why the runtime refuses TeraPipe with cp=2 (raised before any actor starts); None if it runs."""
    try:
        _pipeline(cfg, args, REFUSED[1]).shutdown()
    except ValueError as e:
        return str(e)
    return None


def _per_rank(actor_peaks: list, cp: int) -> list[float]:
    """Per pipeline rank, the largest of its CP ranks' peaks (actors are ordered rank, then CP rank)."""
    return [max(actor_peaks[r * cp:(r + 1) * cp]) for r in range(len(actor_peaks) // cp)]


def _print(args, configs: dict, peaks: dict, times: dict, predicted: dict, refused: Optional[str]) -> None:
    med, mib = statistics.median, 2.0 ** 20
    actor = {k: [med(p[a] for p in peaks[k]) for a in range(len(peaks[k][0]))] for k in configs}
    rank = {k: _per_rank(actor[k], configs[k].get("cp", 1)) for k in configs}
    step = {k: med(times[k]) for k in configs}
    base = PLAIN if PLAIN in configs else next(iter(configs))
    print(f"GPT d_model {args.d_model}, {args.heads} heads, {args.layers} layers over pp=2, vocab {args.vocab}; one "
          f"microbatch of {args.batch} x {args.seq} tokens; SGD, fp32, CPU (gloo); medians of {args.rounds} "
          f"alternating rounds ({args.steps} timed step(s) each); TeraPipe: {args.slices} slices of "
          f"{args.seq // args.slices}")
    rows = []
    for k in configs:
        rows.append([k, str(len(actor[k])), " / ".join(f"{p / mib:.1f}" for p in actor[k]),
                     f"{max(actor[k]) / mib:.1f}", f"{max(actor[k]) / max(actor[base]):.2f}", f"{step[k] * 1e3:.0f}",
                     f"{predicted[k] * 1e3:.0f}", f"{step[k] / predicted[k]:.2f}", f"{step[k] / step[base]:.2f}"])
    rows.append([REFUSED[0], "-", "refused", "-", "-", "-", "-", "-", "-"] if refused else
                [REFUSED[0], "?", "ran (not refused)", "-", "-", "-", "-", "-", "-"])
    print_table(["configuration", "actors", "peak MiB per actor", "max MiB", f"x {base}", "step ms", "predicted ms",
                 "measured/pred", f"x {base}"], rows)
    if refused:
        print(f"{REFUSED[0]}: refused before any actor starts: {refused}")
    if TILED in configs and CP2 in configs:
        ratios = [c / t for c, t in zip(rank[CP2], rank[TILED])]
        print("memory target (cp=2 <= 0.55x cp=1, same microbatch, the same tiled attention), per pipeline rank: "
              + ", ".join(f"rank {r} {q:.3f}x" for r, q in enumerate(ratios))
              + f"; worst {max(ratios):.3f}x: {'met' if max(ratios) <= 0.55 else 'MISSED'}")
    if PLAIN in configs and CP2 in configs:
        print(f"cp=2 against the plain pipeline (its own S x S attention): worst rank "
              f"{max(c / p for c, p in zip(rank[CP2], rank[PLAIN])):.3f}x")
    print("peak: VmHWM during a step above the actor's trimmed resident size before it (the activations, gradients "
          "and transients); actors in order rank 0 (cp 0, cp 1), rank 1 (...); predicted: the calibrated cost model "
          "fitted on profiled steps of the same actors, simulated on the pipeline's program")
    print("")
    print(f"causal attention work per CP rank at S = {args.seq}, largest over the mean:")
    print_table(["cp", "zigzag (head + tail)", "contiguous"], balance_rows(args.seq))
