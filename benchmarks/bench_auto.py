"""``python -m mpmd bench auto [--measure-all N]``: what ``schedule="auto"`` chose, the
candidates it rejected, and how its predictions compare with measured step times.

A Pipeline with ``schedule="auto", num_microbatches="auto"`` on the bench GPT decides
(Note [calibrated auto] in mpmd/planning/replan.py).  The report lists the options by
the calibrated prediction, with the controller-only prediction beside it.  With
``--measure-all N`` the N best-predicted options that fit (plus auto's choice and the
controller-only choice) are each run as their own Pipeline and measured: all of them
alive at once (idle actors cost no CPU), taking turns for ``rounds`` rounds, so a change
in the machine's load falls on every option alike.  Auto's choice runs twice, in two
pipelines: how far apart the two copies of one plan measure is the harness's own noise
floor, printed beside how far auto's choice is from the fastest measured option (the
target: within 5%; on the 2-core VM six copies of one plan measured 130-145 ms over 6
rounds of 2 steps, 102-107 ms over 20).
"""

from __future__ import annotations

import random
import statistics
from typing import Any, Callable, Optional, Sequence

from mpmd.profiler import format_table
from .bench_config import add_config_arguments, bench_model, bench_optimizer, config_from_args, placement
from .harness import PipelineSet, ensure_ray, progress, time_rounds

__all__ = ["HELP", "add_arguments", "measure_options", "auto_report", "run_auto", "copy_key"]

HELP = "what schedule='auto' chose for the bench GPT, the options it rejected, predicted against measured"


def add_arguments(p) -> None:
    add_config_arguments(p, schedules=False, microbatches=False)
    p.add_argument("--stages", type=int, default=4, help="stages of the bench GPT (default: 4)")
    p.add_argument("--measure-all", type=int, default=0, metavar="N",
                   help="also run the N best-predicted options (and auto's choice) and measure them")
    p.set_defaults(run=_run)


def _run(args) -> int:
    # auto chooses the schedule and the microbatches: none to check against the model here
    cfg = config_from_args(args, schedules=(), microbatches=1)
    if cfg is None:
        return 2
    print(f"mpmd bench auto: {cfg.actors} actors (progress on stderr)")
    run_auto(cfg, measure_all=args.measure_all, stages_count=args.stages, log=print, progress=progress)
    return 0


def copy_key(key: tuple) -> tuple:
    """The key a second pipeline running the same option is measured under."""
    return ("copy",) + tuple(key)


def measure_options(stages: Sequence, batches: Sequence, options: Sequence, *, rounds: int = 20, steps: int = 2,
                    warmup: int = 8, progress: Callable[[str], None] = lambda msg: None, duplicate=None,
                    **pipeline_kwargs: Any) -> dict:
    """Per option key, the step seconds measured (``rounds`` x ``steps``) by a Pipeline
    running that option on ``stages``; ``pipeline_kwargs``: the other Pipeline arguments.
    Each pipeline first runs ``warmup`` steps (fresh actors run their first 5-8 steps up to
    1.15x slower), and one untimed step at the start of each turn (after another's).
    ``duplicate``: one of ``options`` that a second pipeline runs too, measured under
    ``copy_key(option.key)``: the harness's noise floor."""
    import mpmd

    with PipelineSet() as pipes:
        runs = [(o.key, o) for o in options] + ([(copy_key(duplicate.key), duplicate)] if duplicate else [])
        for key, o in runs:
            if key in pipes:
                continue
            progress(f"  starting {o.schedule} m={o.num_microbatches} on {o.num_ranks} actors")
            pipes[key] = mpmd.Pipeline(stages, schedule=o.schedule, num_microbatches=o.num_microbatches,
                                       num_actors=o.num_ranks, recompute=o.recompute or False,
                                       **{"zero": o.zero, **pipeline_kwargs})  # auto may have chosen zero=1
        for pipe in pipes.values():
            for i in range(warmup):
                pipe.step(*batches[i % len(batches)])
        # untimed_first: back from another pipeline's turn; shuffled: no option always runs
        # right after the same other one
        turn = [batches[i % len(batches)] for i in range(steps)]
        return time_rounds(pipes, turn, rounds, shuffle=random.Random(0), untimed_first=True,
                           progress=progress).seconds


def auto_report(decision, measured: Optional[dict] = None, shown: int = 12) -> list[str]:
    """The options by calibrated prediction, the controller-only prediction beside each,
    and the measured medians of ``measured`` (option key -> step seconds)."""
    measured = measured or {}
    before = {o.key: o for o in decision.provisional.options} if decision.provisional else {}
    first = decision.provisional.chosen.key if decision.provisional else None
    copy = measured.get(copy_key(decision.chosen.key))
    median = {k: statistics.median(v) for k, v in measured.items() if v and k[:1] != ("copy",)}
    rows = [o for o in decision.options if o.fits][:shown]
    rows += [o for o in decision.options if o.key in median and o not in rows]
    header = ("", "schedule", "actors", "m", "recompute", "controller ms", "calibrated ms", "trial ms",
              "measured ms", "measured/calibrated")
    table = []
    for o in rows:
        mark = ("*" if o.key == decision.chosen.key else "") + ("p" if o.key == first else "")
        ctrl = before.get(o.key)
        meas = median.get(o.key)
        table.append((mark, o.schedule, str(o.num_ranks), str(o.num_microbatches),
                      ",".join(map(str, o.recompute)) or "-",
                      f"{ctrl.step_s * 1e3:.1f}" if ctrl else "-", f"{o.step_s * 1e3:.1f}",
                      f"{o.measured_s * 1e3:.1f}" if o.measured_s else "-",
                      f"{meas * 1e3:.1f}" if meas else "-", f"{meas / o.step_s:.2f}" if meas else "-"))
    lines = [f"schedule='auto': {len(decision.options)} options simulated ({sum(o.fits for o in decision.options)} "
             f"fit), {len(decision.skipped)} refused by schedule constraints; the best {len(rows)} by the calibrated "
             f"model (* auto's choice, p the controller-only choice; trial: measured during auto's own trials)"]
    lines += format_table(header, table)
    lines += list(decision.calibration)
    if decision.chosen.key in median and len(median) > 1:
        best = min(median, key=median.get)
        ratio = median[decision.chosen.key] / median[best]
        lines.append(f"auto's choice measured {median[decision.chosen.key] * 1e3:.1f} ms: {ratio:.3f}x the fastest "
                     f"measured option ({best[0]} m={best[1]}, {median[best] * 1e3:.1f} ms); target <= 1.05")
        if copy:
            twin = statistics.median(copy)
            lines.append(f"noise floor: auto's choice in a second pipeline measured {twin * 1e3:.1f} ms, "
                         f"{max(twin, median[decision.chosen.key]) / min(twin, median[decision.chosen.key]):.3f}x "
                         f"apart (the same plan)")
        if first in median:
            lines.append(f"the controller-only choice measured {median[first] * 1e3:.1f} ms: "
                         f"{median[first] / median[best]:.3f}x the fastest")
        errors = [abs(median[o.key] / o.step_s - 1) for o in decision.options if o.key in median]
        lines.append(f"calibrated prediction error over the measured options: mean {statistics.fmean(errors):.1%}, "
                     f"max {max(errors):.1%}")
    return lines


def run_auto(cfg, measure_all: int = 0, stages_count: int = 4, log: Callable[[str], None] = print,
             progress: Callable[[str], None] = lambda msg: None) -> dict:
    """``schedule="auto"`` on the bench GPT cut into ``stages_count`` stages on ``cfg.actors``
    actors, and with ``measure_all`` the best options measured."""
    import mpmd

    from mpmd.models import lm_loss

    # Logical CPUs for every measured option's actors at once (idle ones cost nothing).
    ensure_ray(cfg.actors * 2 * (measure_all + 3))
    stages, batches = bench_model(cfg, stages_count)
    common = dict(loss_fn=lm_loss, optimizer=bench_optimizer, **placement(cfg))
    progress("  schedule='auto': timing the stages, then trials on the actors")
    with mpmd.Pipeline(stages, schedule="auto", num_microbatches="auto", sample=batches[0], num_actors=cfg.actors,
                       **common) as pipe:
        decision = pipe.auto_decision
    measured = {}
    if measure_all:
        fitting = [o for o in decision.options if o.fits][:measure_all]
        extra = [decision.chosen] + ([decision.provisional.chosen] if decision.provisional else [])
        measured = measure_options(stages, batches, fitting + extra, duplicate=decision.chosen,
                                   warmup=max(cfg.warmup, 8), progress=progress, **common)
    log("")
    log(f"auto report: bench GPT (d_model {cfg.d_model}, {cfg.n_layers} layers, seq {cfg.seq_len}) in "
        f"{stages_count} stages, batch {cfg.batch_size}, {cfg.actors} actors")
    for line in auto_report(decision, measured):
        log(line)
    return {"decision": decision, "measured": measured}
