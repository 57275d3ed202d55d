"""``python -m mpmd``: training, the demo, schedule inspection, profiling, export, the benchmarks.

    lm.py          python -m mpmd train CONFIG: language-model pretraining from a config (mpmd/lm)
    train.py       python -m mpmd demo | profile
    demo.py        the demo run (make demo) and its text (data/pipeline.txt)
    schedule.py    python -m mpmd schedule list | show ...   (no Ray, no actors)
    export.py      python -m mpmd export CHECKPOINT --hf OUT: a checkpoint's weights as HF safetensors, offline

``python -m mpmd bench NAME [options]`` runs the benchmarks, a package of their own
(``benchmarks/``, beside ``mpmd/``), imported here only when the command is ``bench``
(Note [benchmarks outside the library] in ``benchmarks/__init__.py``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

__all__ = ["main", "build_parser"]

BENCH_HELP = "the benchmarks: python -m mpmd bench --list names them"


def build_parser(*, benches: bool = False) -> argparse.ArgumentParser:
    """The parser of ``python -m mpmd``; ``benches``: with the ``bench`` command's benchmarks and
    their options (which imports them), else ``bench`` is only named."""
    from . import export, lm, schedule, train

    parser = argparse.ArgumentParser(prog="python -m mpmd", description="mpmd: MPMD pipeline-parallel training on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    lm.add_parser(sub)
    train.add_parsers(sub)
    schedule.add_parser(sub)
    if benches:
        from benchmarks import add_parser as add_bench_parser

        add_bench_parser(sub, help=BENCH_HELP)
    else:
        sub.add_parser("bench", help=BENCH_HELP)
    export.add_parser(sub)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    benches = bool(argv) and argv[0].startswith("bench")  # bench NAME, or an old spelling (bench-NAME)
    if benches:
        from benchmarks import old_spelling

        hint = old_spelling(argv)
        if hint:
            print(f"python -m mpmd: error: {hint}", file=sys.stderr)
            return 2
    args = build_parser(benches=benches).parse_args(argv)
    return int(args.run(args) or 0)
