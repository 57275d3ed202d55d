"""CLI: demo, profile and bench (filled in by the runtime and profiling work)."""

from __future__ import annotations


def add_parsers(sub) -> None:
    p = sub.add_parser("demo", help="train the demo model on a local Ray")
    p.set_defaults(run=_demo)


def _demo(args) -> int:
    from ._demo import run_demo

    return run_demo()
