"""``python -m mpmd``: training, the demo, schedule inspection, profiling, the benchmarks, export.

    lm.py          python -m mpmd train CONFIG: language-model pretraining from a config (mpmd/lm)
    train.py       python -m mpmd demo | profile
    demo.py        the demo run (make demo) and its text (data/pipeline.txt)
    schedule.py    python -m mpmd schedule list | show ...   (no Ray, no actors)
    export.py      python -m mpmd export CHECKPOINT --hf OUT: a checkpoint's weights as HF safetensors, offline
    benches.py     python -m mpmd bench NAME [options]: every benchmark (bench --list names them)
    harness.py     what the benchmarks share: Ray for them, timed steps, alternating rounds, ratios, tables
    bench_config.py  the bench GPT and its options (bench steps, predict, auto)

  The benchmarks, one module each (python -m mpmd bench NAME):
    bench.py          steps: this runtime against one process and torch.distributed.pipelining
    bench_predict.py  predict: measured step time and bubble against the cost models
    bench_auto.py     auto: schedule='auto''s choice against its candidates
    bench_dispatch.py dispatch: controller dispatch per actor, p = 2..16
    bench_first.py    first: the first pipeline after ray.init against the next
    bench_fill.py     fill: PipeFill's cost to the main job
    bench_recipe.py   recipe: recompute and bf16 against fp32
    bench_memory.py   memory: bytes/param/actor and step time, zero=0 against zero=1
    bench_peaks.py    peaks: the memory model's predicted peak per actor against the measured one
    bench_tp.py       tp: bytes per actor and step time, tp=2 against tp=1 (GPT, HF Llama)
    bench_phases.py   phases: each process's peak memory by phase (build, save, load, export)
    bench_ckpt.py     ckpt: checkpoint save/load, through the controller against sharded
    ckpt_baseline.py  the checkpoint path before sharding, bench ckpt's baseline
    bench_recovery.py recovery: seconds from an actor's death to the next step, by phase
    bench_compile.py  compile: mpmd train's parallel.compile against eager
    bench_layers.py   layers: mpmd train's parallel.layers = "balanced" against equal layers
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    from . import benches, export, lm, schedule, train

    parser = argparse.ArgumentParser(prog="python -m mpmd", description="mpmd: MPMD pipeline-parallel training on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    lm.add_parser(sub)
    train.add_parsers(sub)
    schedule.add_parser(sub)
    benches.add_parser(sub)
    export.add_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from .benches import old_spelling

    argv = sys.argv[1:] if argv is None else list(argv)
    hint = old_spelling(argv)
    if hint:
        print(f"python -m mpmd: error: {hint}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)
