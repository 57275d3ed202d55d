"""``python -m mpmd schedule``: inspect pipeline schedules without Ray or torch.

    python -m mpmd schedule list
    python -m mpmd schedule show 1f1b --ranks 4 --microbatches 8 [--stages-per-rank V] [--lowered] [--tie 0,3]
    python -m mpmd schedule show dualpipev -p 2 -m 8 --overlap [--a2a 0.5]

Only ``schedules`` is used here: no Ray is started, no actor, nothing is trained.
"""

from __future__ import annotations

import argparse
import sys

import schedules


def add_parser(sub) -> None:
    """Register ``schedule`` (with ``show`` and ``list``) on an argparse subparsers object."""
    p = sub.add_parser("schedule", help="show or list pipeline schedules (no Ray needed)")
    p.set_defaults(run=lambda args: _usage(p))
    cmds = p.add_subparsers(dest="schedule_command", metavar="{show,list}")

    show = cmds.add_parser("show", help="print a schedule's rank x time grid, bubble and peak activations")
    show.add_argument("name", help="registered schedule name (see 'schedule list')")
    show.add_argument("--ranks", "-p", type=int, required=True, help="pipeline ranks (actors)")
    show.add_argument("--microbatches", "-m", type=int, required=True, help="microbatches per step")
    show.add_argument("--stages-per-rank", "-v", type=int, default=None,
                      help="stages per rank (default: the schedule's own, e.g. 2 for interleaved-1f1b)")
    show.add_argument("--lowered", action="store_true",
                      help="also print each rank's lowered program (send/recv and frees added)")
    show.add_argument("--tie", action="append", default=[], metavar="STAGES",
                      help="stages that share parameters, e.g. 0,3 for tied embeddings (repeatable): the lowered "
                           "program sums their gradients (TIE_REDUCE)")
    show.add_argument("--overlap", action="store_true",
                      help="its forward-backward pairs as OVERLAP actions (dualpipev; docs/overlap.md)")
    show.add_argument("--a2a", type=float, default=0.0, metavar="UNITS",
                      help="expert all-to-all inside each forward and backward, in compute units: the makespan "
                           "with it, without and with --overlap (Note [all-to-all costs])")
    show.set_defaults(run=_show)

    lst = cmds.add_parser("list", help="list the registered schedules")
    lst.set_defaults(run=_list)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_usage(sys.stderr)
    print("error: choose a subcommand: show or list", file=sys.stderr)
    return 2


def _show(args: argparse.Namespace) -> int:
    try:
        paper = schedules.get_schedule(args.name, args.ranks, args.microbatches, args.stages_per_rank,
                                       overlap=args.overlap)
        sched = schedules.fuse_backwards(paper)  # as a Pipeline runs it (Note [fused where free])
        result = schedules.simulate(sched)
        ties = [_stages(t) for t in args.tie]
        lowered = schedules.lower(sched, ties=ties) if args.lowered or ties else None
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    v = sched.num_stages // sched.num_ranks
    print(f"{sched.name}: {sched.num_ranks} ranks, {sched.num_microbatches} microbatches, "
          f"{v} stage(s) per rank (unit costs: F = 1, B = 2, one column per unit)")
    if sched is not paper:
        print("as a Pipeline runs it: an I + W pair the timeline does not use split is one B (schedules/fuse.py)")
    print(sched.render())
    print()
    print(f"bubble fraction (unit costs): {result.bubble_fraction:.4f}")
    print(f"makespan (unit costs): {result.makespan:g}")
    print("peak activations per rank: " + ", ".join(str(n) for n in result.peak_activations))
    if args.a2a:
        _a2a(args, sched)
    if lowered is not None:
        print()
        print("lowered program per rank:")
        for r, line in enumerate(lowered.to_text().splitlines()):
            print(f"rank {r}: {line}")
    return 0


def _a2a(args: argparse.Namespace, sched: schedules.Schedule) -> None:
    """The makespan with ``args.a2a`` units of all-to-all in each forward and backward: as
    shown, and (a schedule with pairs) with its pairs written in turn and overlapped."""
    costs = schedules.Costs(a2a_f=args.a2a, a2a_b=args.a2a)
    print(f"makespan with {args.a2a:g} of all-to-all per forward and backward: "
          f"{schedules.simulate(sched, costs).makespan:g}")
    if schedules.schedule_info(args.name).overlapped is not None:
        for overlap in (False, True):
            other = schedules.fuse_backwards(schedules.get_schedule(args.name, args.ranks, args.microbatches,
                                                                    args.stages_per_rank, overlap=overlap))
            print(f"  {'with' if overlap else 'without'} OVERLAP: {schedules.simulate(other, costs).makespan:g}")


def _stages(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(s) for s in text.split(","))
    except ValueError:
        raise ValueError(f"--tie takes stage numbers separated by commas, e.g. --tie 0,3; got {text!r}") from None


def _list(args: argparse.Namespace) -> int:
    names = schedules.schedule_names()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name.ljust(width)}  {schedules.schedule_info(name).description}")
    return 0
