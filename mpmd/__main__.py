"""``python -m mpmd``: schedule inspection, the demo, profiling and the benchmark."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpmd", description="mpmd: MPMD pipeline-parallel training on Ray")
    sub = parser.add_subparsers(dest="command", required=True)
    from . import _bench_fill, _cli_schedule, _cli_train

    _cli_schedule.add_parser(sub)
    _cli_train.add_parsers(sub)
    _bench_fill.add_parser(sub)
    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
