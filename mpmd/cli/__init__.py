"""``python -m mpmd``: schedule inspection, the demo, profiling and the benchmarks.

    schedule.py    python -m mpmd schedule list | show ...   (no Ray, no actors)
    train.py       python -m mpmd demo | profile | bench
    lm.py          python -m mpmd train CONFIG: language-model pretraining from a config (mpmd/lm)
    bench_compile.py python -m mpmd bench-compile: mpmd train's parallel.compile against eager
    demo.py        the demo run (make demo) and its text (data/pipeline.txt)
    bench.py       this runtime against one process and torch.distributed.pipelining
    bench_fill.py  python -m mpmd bench-fill: PipeFill's cost to the main job
    bench_recipe.py python -m mpmd bench-recipe: recompute and bf16 against fp32
    bench_auto.py  python -m mpmd bench --auto: schedule='auto''s choice against its candidates
    bench_dispatch.py python -m mpmd bench-dispatch: controller dispatch per actor, p = 2..16
    bench_ckpt.py  python -m mpmd bench-ckpt: checkpoint save/load, through the controller against sharded
    ckpt_baseline.py  the checkpoint path before sharding, bench-ckpt's baseline
    bench_memory.py python -m mpmd bench-memory: bytes/param/actor and step time, zero=0 against zero=1
    bench_first.py python -m mpmd bench-first: the first pipeline after ray.init against the next
    bench_recovery.py python -m mpmd bench-recovery: seconds from an actor's death to the next step, by phase
    bench_tp.py    python -m mpmd bench-tp: bytes per actor and step time, tp=2 against tp=1 (GPT, HF Llama)
    export.py      python -m mpmd export CHECKPOINT --hf OUT: a checkpoint's weights as HF safetensors, offline
    bench_phases.py python -m mpmd bench-phases: each process's peak memory by phase (build, save, load, export)
"""

from __future__ import annotations

import argparse
from typing import Optional

__all__ = ["main"]


def main(argv: Optional[list[str]] = None) -> int:
    from . import (bench_ckpt, bench_compile, bench_dispatch, bench_first, bench_fill, bench_memory, bench_phases,
                   bench_recipe, bench_recovery, bench_tp, export, lm, schedule, train)

    parser = argparse.ArgumentParser(prog="python -m mpmd", description="mpmd: MPMD pipeline-parallel training on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    schedule.add_parser(sub)
    train.add_parsers(sub)
    lm.add_parser(sub)
    bench_compile.add_parser(sub)
    bench_fill.add_parser(sub)
    bench_recipe.add_parser(sub)
    bench_dispatch.add_parser(sub)
    bench_ckpt.add_parser(sub)
    bench_memory.add_parser(sub)
    bench_first.add_parser(sub)
    bench_recovery.add_parser(sub)
    bench_tp.add_parser(sub)
    bench_phases.add_parser(sub)
    export.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)
