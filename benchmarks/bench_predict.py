"""``python -m mpmd bench predict``: how well the simulator predicts the runtime.

Per schedule, on the bench GPT: the measured step time (median of ordinary steps,
fusion=step) against two predictions, each from profiled steps of the same actors:
the profiler's task costs alone (``ProfileReport.predicted_step_seconds``, the
schedule's compute and hops plus the optimizer step) and the calibrated cost model
(``ProfileReport.calibrated_step_seconds``: per-task and per-message costs,
transfers, prefetched receives and the step's own overhead too; Note [runtime costs]
in schedules/costs.py); and the measured bubble against both simulated ones.
"""

from __future__ import annotations

import statistics
from typing import Callable, Optional

from mpmd.profiler import format_table, held_out, profile_pipeline
from .bench_config import (BenchConfig, add_config_arguments, bench_model, bench_optimizer, config_from_args,
                           placement, stages_per_rank)
from .harness import ensure_ray, progress, timed

__all__ = ["HELP", "add_arguments", "predict_schedule", "run_predict", "table_predict"]

HELP = "measured step time and bubble against the old and the calibrated cost model, per schedule"


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.set_defaults(run=_run)


def _run(args) -> int:
    cfg = config_from_args(args)
    if cfg is None:
        return 2
    print(f"mpmd bench predict: {', '.join(cfg.schedules)} on {cfg.actors} processes (progress on stderr)")
    run_predict(cfg, log=print, progress=progress)
    return 0


def predict_schedule(cfg: BenchConfig, name: str, profiled: int = 6) -> dict:
    """Ordinary steps around ``profiled`` profiled steps, on one set of actors, and the
    calibrated model's held-out prediction (``held_out``)."""
    import mpmd

    from mpmd.models import lm_loss

    stages, batches = bench_model(cfg, cfg.actors * stages_per_rank(name))
    with mpmd.Pipeline(stages, schedule=name, num_microbatches=cfg.microbatches, num_actors=cfg.actors,
                       loss_fn=lm_loss, optimizer=bench_optimizer, **placement(cfg)) as pipe:
        run = lambda i: timed(pipe.step, *batches[i % len(batches)])  # noqa: E731
        for i in range(cfg.warmup):
            run(i)
        # Ordinary steps before and after the profiled ones: a slow spell on the shared
        # machine falls on both the measurement and the calibration.
        times = [run(i) for i in range(cfg.steps // 2)]
        x, y = batches[-1]
        report = profile_pipeline(pipe.engine, x, y, steps=profiled, warmup=0)  # message sizes from the actors
        times += [run(i) for i in range(cfg.steps - cfg.steps // 2)]
        schedule, programs = pipe.engine.schedule, pipe.engine.program("train")
    return {"step": statistics.median(times), "steps": times, "profile": report, **held_out(report, schedule, programs)._asdict()}


def _spread(slices) -> float:
    """Mean over median of the compute durations of each actor and kind, averaged: how much
    stragglers (a core taken by another process) stretch compute (1.00: none)."""
    groups: dict = {}
    for x in slices:
        if x.kind in ("F", "B", "I", "W"):
            groups.setdefault((x.actor, x.kind), []).append(x.seconds)
    ratios = [statistics.mean(v) / statistics.median(v) for v in groups.values() if statistics.median(v) > 0]
    return statistics.mean(ratios) if ratios else float("nan")


def run_predict(cfg: BenchConfig, log: Callable[[str], None] = print,
                progress: Optional[Callable[[str], None]] = None) -> dict:
    progress = progress or (lambda msg: None)
    ensure_ray(cfg.actors)
    results = {}
    for name in cfg.schedules:
        progress(f"  {name}: {cfg.steps} steps, then profiled steps")
        results[name] = predict_schedule(cfg, name)
    log("")
    for line in table_predict(cfg, results):
        log(line)
    return results


def table_predict(cfg: BenchConfig, results: dict) -> list[str]:
    header = ("schedule", "measured ms", "old model ms", "measured/old", "calibrated ms", "measured/calibrated",
              "profiled ms", "held-out ms", "profiled/held-out", "bubble measured", "old", "calibrated")
    rows, notes = [], []
    for name, r in results.items():
        rep, step = r["profile"], r["step"]
        cal, hm, hp = rep.calibrated_step_seconds, r["measured"], r["predicted"]
        rows.append((name, f"{step * 1e3:.1f}", f"{rep.predicted_step_seconds * 1e3:.1f}",
                     f"{step / rep.predicted_step_seconds:.2f}", f"{cal * 1e3:.1f}", f"{step / cal:.2f}",
                     f"{hm * 1e3:.1f}", f"{hp * 1e3:.1f}", f"{hm / hp:.2f}", f"{rep.bubble_fraction:.3f}",
                     f"{rep.predicted_bubble_fraction:.3f}", f"{r['bubble']:.3f}"))
        c = rep.calibrated_costs
        links = ", ".join(f"{s}->{d} {link.latency * 1e3:.3f}" for (s, d), link in sorted(c.links.items()))
        spread = _spread(rep.slices)
        notes.append(f"{name}: compute mean/median {spread:.2f} (1.00: no stragglers); task {c.task * 1e3:.3f} ms, message {c.message * 1e3:.3f} ms, latency ms {links or '-'}, "
                     f"launch ms [{', '.join(f'{v * 1e3:.2f}' for v in c.values('launch'))}], "
                     f"optimizer ms [{', '.join(f'{v * 1e3:.2f}' for v in c.values('optimizer'))}], "
                     f"step overhead {c.step_overhead * 1e3:.2f} ms; measured steps ms "
                     f"{', '.join(f'{t * 1e3:.0f}' for t in r['steps'])}; profiled steps "
                     f"ms {', '.join(f'{t * 1e3:.0f}' for t in rep.step_seconds_each)}")
    return ([f"Prediction report: bench GPT (d_model {cfg.d_model}, {cfg.n_layers} layers, seq {cfg.seq_len}), batch "
             f"{cfg.batch_size} = {cfg.microbatches} microbatches, {cfg.actors} actors; measured: median of "
             f"{cfg.steps} ordinary steps around 6 profiled ones, after {cfg.warmup} warm-up; both models fitted on the "
             f"profiled steps; held-out: fitted on every other profiled step, scored on the rest"]
            + format_table(header, rows)
            + ["old model: the profiler's task costs (compute, send/receive folded in, one hop latency) + optimizer "
               "step; calibrated: Note [runtime costs] (per-task and per-message costs, per-pair latency, prefetched "
               "receives, launch and optimizer step per rank, step overhead); held-out: the calibrated model fitted on every other "
               "profiled step and scored on the others (profiled ms: their mean)"] + notes)
