"""``python -m mpmd bench NAME [options]``: every benchmark under one command.

``python -m mpmd bench --list`` names them, each with what it measures, and ``python -m
mpmd bench NAME --help`` gives one's options.  A bench is a module of this folder with a
one-line ``HELP`` and ``add_arguments(parser)``, which also sets the parser's ``run``; what
the benches share (Ray for them, timed steps, alternating rounds, ratios, tables) is in
``harness.py``.  ``mpmd/cli`` adds the command only when it runs (Note [benchmarks outside
the library] in ``benchmarks/__init__.py``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from . import (bench, bench_auto, bench_ckpt, bench_compile, bench_context, bench_controller, bench_data, bench_dispatch, bench_fill,
               bench_first, bench_layers, bench_memory, bench_moe, bench_overhead, bench_peaks, bench_phases, bench_predict,
               bench_recipe, bench_recovery, bench_tp, bench_versus)
from . import bench_startup

__all__ = ["BENCHES", "add_parser", "listing", "old_spelling"]

# name -> module, in the order --list shows them
BENCHES = {
    "steps": bench,
    "predict": bench_predict,
    "auto": bench_auto,
    "dispatch": bench_dispatch,
    "controller": bench_controller,
    "overhead": bench_overhead,
    "versus": bench_versus,
    "first": bench_first,
    "fill": bench_fill,
    "recipe": bench_recipe,
    "memory": bench_memory,
    "peaks": bench_peaks,
    "tp": bench_tp,
    "moe": bench_moe,
    "context": bench_context,
    "phases": bench_phases,
    "ckpt": bench_ckpt,
    "recovery": bench_recovery,
    "compile": bench_compile,
    "layers": bench_layers,
    "data": bench_data,
    "startup": bench_startup,
}


def listing() -> list[str]:
    """One line a bench: its name and what it measures."""
    width = max(map(len, BENCHES))
    return [f"  {name:<{width}}  {module.HELP}" for name, module in BENCHES.items()]


class _ListAction(argparse.Action):
    """``--list``: print the benches and exit, as ``--help`` does."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print("python -m mpmd bench NAME [options] (NAME --help: its options); NAME is one of:")
        print("\n".join(listing()))
        parser.exit()


def add_parser(sub, help: str) -> None:
    """The ``bench`` command on ``sub`` (the CLI's subcommands), ``help`` its line in ``python -m mpmd --help``."""
    p = sub.add_parser("bench", help=help,
                       description="Benchmarks, each printing a table with ratios against a baseline measured in "
                                   "the same run.", epilog="benchmarks:\n" + "\n".join(listing()),
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action=_ListAction, nargs=0, help="name every benchmark with what it measures, and exit")
    names = p.add_subparsers(dest="bench", metavar="NAME")
    for name, module in BENCHES.items():
        q = names.add_parser(name, help=module.HELP, description=module.__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(q)
    p.set_defaults(run=_no_name)


def _no_name(args) -> int:
    print("python -m mpmd bench: name a benchmark: python -m mpmd bench NAME [options]; NAME is one of:",
          file=sys.stderr)
    print("\n".join(listing()), file=sys.stderr)
    return 2


def old_spelling(argv: Sequence[str]) -> Optional[str]:
    """What to type instead, when ``argv`` spells a bench the way it was before one ``bench``
    command held them all (``bench-ckpt``, ``bench --auto``, ``bench --schedule ...``)."""
    if not argv:
        return None
    first, rest = argv[0], list(argv[1:])
    if first.startswith("bench-"):
        name = first.removeprefix("bench-")
        if name not in BENCHES:
            return f"no command {first!r}; the benchmarks are python -m mpmd bench NAME (bench --list names them)"
    elif first == "bench" and rest and rest[0].startswith("-") and rest[0] not in ("--list", "-h", "--help"):
        name = next((flag[2:] for flag in ("--auto", "--predict") if flag in rest), "steps")
        rest = [a for a in rest if a not in ("--auto", "--predict")]
    else:
        return None
    return "the benchmarks are one command now (bench --list names them); use: python -m mpmd bench " + \
        " ".join([name] + rest)
