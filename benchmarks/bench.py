"""``python -m mpmd bench steps``: this runtime against single-process training and
``torch.distributed.pipelining``, all measured in one run on one model.

Table 1 (per schedule): step time, speedup over one process, throughput ratio to the
torch pipeline and controller dispatch, for fusion none / consecutive / step.
Table 2: controller dispatch per step as ``num_microbatches`` grows, with stages that
cost almost nothing, so dispatch is all there is to see.
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from typing import Callable, Optional

import torch

from mpmd.profiler import format_table, profile_pipeline
from .bench_config import (BenchConfig, add_config_arguments, bench_model, bench_optimizer, config_from_args,
                           placement, stages_per_rank)
from .harness import ensure_ray, progress, ratios_text

__all__ = ["HELP", "add_arguments", "BenchConfig", "run_bench", "TORCH_SCHEDULES", "MODES", "use_fusion",
           "measure_mpmd", "measure_ahead", "measure_single", "measure_torch", "measure_schedule", "table_steps",
           "table_dispatch"]

HELP = "step time and dispatch against one process and torch.distributed.pipelining"

# The ways this runtime issues a step: the fusion modes, and step fusion over Ray tasks
# instead of the step channel (Note [step channel] in actors/channel.py).
MODES = ("step", "step-ray", "consecutive", "none")
_LABELS = {"step": "mpmd fusion=step", "step-ray": "mpmd fusion=step, Ray task", "consecutive": "mpmd fusion=consecutive",
           "none": "mpmd fusion=none"}

# Our schedule name -> torch.distributed.pipelining schedule class name.
# zb-h1 (one stage per rank, B split into I and W) runs as torch's interleaved zero-bubble
# schedule with one stage per rank; zbv and dualpipev place stages in a V, as ours do.
TORCH_SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
                   "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
                   "dualpipev": "ScheduleDualPipeV"}
V_SHAPED = ("zbv", "dualpipev")


def add_arguments(p) -> None:
    add_config_arguments(p)
    p.add_argument("--dispatch-microbatches", default="8,32,128",
                   help="microbatch counts of the dispatch table; '' skips it (default: 8,32,128)")
    p.add_argument("--no-torch", action="store_true", help="skip the torch.distributed.pipelining rows")
    p.add_argument("--rounds", type=int, default=4,
                   help="alternating rounds of torch and the fit loop, for the paired vs-torch ratio (default: 4)")
    p.set_defaults(run=_run)


def _run(args) -> int:
    cfg = config_from_args(args, torch_pipelining=not args.no_torch, rounds=args.rounds,
                           dispatch_microbatches=tuple(int(x) for x in args.dispatch_microbatches.split(",")
                                                       if x.strip()))
    if cfg is None:
        return 2
    print(f"mpmd bench steps: {', '.join(cfg.schedules)} on {cfg.actors} processes (progress on stderr)")
    run_bench(cfg, log=print, progress=progress)
    return 0


# -- rows ------------------------------------------------------------------------------------------------
def measure_single(cfg: BenchConfig) -> list[float]:
    """Plain gradient accumulation in this process, on one thread like each pipeline process.

    (More intra-op threads than free cores makes torch's thread pool spin against
    other processes; on a shared machine that swamps what is measured.)"""
    from mpmd.models import lm_loss

    stages, batches = bench_model(cfg, 1)
    model = torch.nn.Sequential(*stages).to(cfg.device)
    batches = [(x.to(cfg.device), y.to(cfg.device)) for x, y in batches]
    opt = bench_optimizer(model.parameters())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    times = []
    try:
        for x, y in batches:
            t0 = time.perf_counter()
            for xm, ym in zip(x.chunk(cfg.microbatches), y.chunk(cfg.microbatches)):
                (lm_loss(model(xm), ym) / cfg.microbatches).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cfg.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return times[cfg.warmup:]


def use_fusion(pipe, mode: str) -> None:
    """Switch how the controller cuts each program into RPCs (one of ``MODES``).

    Fusion only decides the RPC boundaries and the step channel only how a one-call step
    travels (``Engine.set_fusion``); actors and programs stay the same, so one set of
    actors measures every mode, step by step in turn, and load on the machine falls on
    every mode alike."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; use one of {', '.join(MODES)}")
    pipe.engine.set_fusion(mode.removesuffix("-ray"), step_channel=mode == "step")


def measure_mpmd(pipe, batches: list, warmup: int, steps: int, fusions=MODES, ahead: bool = True) -> dict:
    """Per fusion mode: step times, dispatch seconds and RPCs of each measured step."""
    out = {f: {"step": [], "dispatch": [], "rpcs": []} for f in fusions}
    for i in range(warmup + steps):
        x, y = batches[i % len(batches)]
        for f in fusions:
            use_fusion(pipe, f)
            t0 = time.perf_counter()
            pipe.step(x, y)
            dt = time.perf_counter() - t0
            if i >= warmup:
                out[f]["step"].append(dt)
                out[f]["dispatch"].append(pipe.engine.last_dispatch.wall_s)
                out[f]["rpcs"].append(pipe.engine.last_dispatch.rpcs)
    use_fusion(pipe, "step")
    if ahead:
        out["ahead"] = {"step": measure_ahead(pipe, batches, warmup, steps)}
    return out


def measure_ahead(pipe, batches: list, warmup: int, steps: int) -> list[float]:
    """Steps as ``fit`` runs them (one issued ahead; Note [one step in flight]): the
    intervals between consecutive steps' completions, after ``warmup`` steps."""
    ends, pending = [], None
    for i in range(warmup + steps + 1):
        x, y = batches[i % len(batches)]
        issued = pipe.step_async(x, y)
        if pending is not None:
            pending.result()
            ends.append(time.perf_counter())
        pending = issued
    pending.result()
    ends.append(time.perf_counter())
    return [b - a for a, b in zip(ends, ends[1:])][warmup:]


def measure_torch(cfg: BenchConfig, schedule: str, model: Optional[Callable] = None,
                  loss: Optional[Callable] = None) -> Optional[list[float]]:
    """Step times of ``torch.distributed.pipelining`` with the same model, stage split, schedule
    and number of processes (gloo, one thread each); None when it has no such schedule.
    ``model(num_stages)``: the stages and batches (default: the bench GPT's), ``loss`` the
    loss (default: ``lm_loss``); both picklable, they travel to torch's processes."""
    if schedule not in TORCH_SCHEDULES:
        return None
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_torch_worker, args=(cfg.actors, port, schedule, cfg, queue, model, loss), nprocs=cfg.actors,
                       join=True, start_method="spawn")
    return queue.get()


def _torch_worker(rank: int, world: int, port: int, schedule: str, cfg: BenchConfig, queue,
                  model: Optional[Callable], loss: Optional[Callable]) -> None:
    import torch.distributed as dist
    from torch.distributed import pipelining

    from mpmd.models import lm_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        num_stages = world * stages_per_rank(schedule)
        stages, batches = model(num_stages) if model is not None else bench_model(cfg, num_stages)
        if schedule in V_SHAPED:  # stage r and 2p-1-r on rank r, as ours
            mine = [rank, num_stages - 1 - rank]
        else:
            mine = [s for s in range(num_stages) if s % world == rank]  # looped placement, as ours
        device = torch.device("cpu")
        pstages = [pipelining.PipelineStage(stages[s], s, num_stages, device) for s in mine]
        opt = bench_optimizer([p for s in mine for p in stages[s].parameters()])
        cls = getattr(pipelining, TORCH_SCHEDULES[schedule])
        multi = len(pstages) > 1 or schedule in ("zb-h1",)  # torch's multi-stage classes take a list
        sched = cls(pstages if multi else pstages[0], cfg.microbatches, loss_fn=loss or lm_loss)
        # Free-running, as a training loop runs: the time per step is the interval between
        # consecutive steps' ends on the last stage's process (which ends each step).
        ends = []
        dist.barrier()
        for i in range(cfg.warmup + cfg.steps + 1):
            x, y = batches[i % len(batches)]
            args = (x,) if 0 in mine else ()
            kwargs = {"target": y, "losses": []} if num_stages - 1 in mine else {}
            sched.step(*args, **kwargs)
            opt.step()
            opt.zero_grad(set_to_none=True)
            ends.append(time.perf_counter())
        dist.barrier()
        if num_stages - 1 in mine:
            queue.put([b - a for a, b in zip(ends, ends[1:])][cfg.warmup:])
    finally:
        dist.destroy_process_group()


def dispatch_scaling(cfg: BenchConfig, progress: Callable[[str], None]) -> list[tuple]:
    """Dispatch per step with near-zero-cost stages (tiny Linear), per microbatch count and fusion."""
    import mpmd

    rows = []
    for m in cfg.dispatch_microbatches:
        torch.manual_seed(0)
        stages = [torch.nn.Linear(4, 4) for _ in range(cfg.actors)]
        batches = [(torch.randn(m, 4), torch.randn(m, 4)) for _ in range(2)]
        progress(f"  dispatch scaling: {m} microbatches")
        with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=m, loss_fn=torch.nn.functional.mse_loss,
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device="cpu") as pipe:
            res = measure_mpmd(pipe, batches, warmup=1, steps=cfg.dispatch_steps, ahead=False)
            tasks = sum(len(p) for p in pipe.engine.program("train"))
        for f in MODES:
            r = res[f]
            disp = statistics.median(r["dispatch"])
            rows.append((m, f, r["rpcs"][-1], tasks, disp, disp / tasks, statistics.median(r["step"])))
    return rows


# -- the tables ----------------------------------------------------------------------------------------
def run_bench(cfg: BenchConfig = BenchConfig(), log: Callable[[str], None] = print,
              progress: Optional[Callable[[str], None]] = None) -> dict:
    """Measure and print (``log``) both tables; returns the raw figures."""
    progress = progress or (lambda msg: None)
    ensure_ray(cfg.actors)
    progress("  single process")
    single = statistics.median(measure_single(cfg))
    results: dict = {"single": single, "schedules": {}}
    for name in cfg.schedules:
        results["schedules"][name] = measure_schedule(cfg, name, progress)
    log("")
    for line in table_steps(cfg, results):
        log(line)
    if cfg.dispatch_microbatches:
        results["dispatch_scaling"] = dispatch_scaling(cfg, progress)
        log("")
        for line in table_dispatch(cfg, results["dispatch_scaling"]):
            log(line)
    return results


def measure_schedule(cfg: BenchConfig, name: str, progress: Callable[[str], None]) -> dict:
    """Our three fusion modes (one set of actors), a profile, and torch's pipeline, for one schedule."""
    import mpmd

    from mpmd.models import lm_loss

    progress(f"  {name}: mpmd ({', '.join(MODES)})")
    stages, batches = bench_model(cfg, cfg.actors * stages_per_rank(name))
    with mpmd.Pipeline(stages, schedule=name, num_microbatches=cfg.microbatches, num_actors=cfg.actors,
                       loss_fn=lm_loss, optimizer=bench_optimizer, **placement(cfg)) as pipe:
        ours = measure_mpmd(pipe, batches, cfg.warmup, cfg.steps)
        x, y = batches[-1]
        report = profile_pipeline(pipe.engine, x, y, steps=3, warmup=0)
    theirs, rounds = None, []
    if cfg.torch_pipelining and name in TORCH_SCHEDULES and cfg.device == "cpu":  # Note [torch on one GPU]
        # Alternating rounds, each a torch run and a fit-loop run back to back: a slow spell on
        # the (shared) machine falls on both halves of a round, and the round's ratio holds.
        with mpmd.Pipeline(stages, schedule=name, num_microbatches=cfg.microbatches, num_actors=cfg.actors,
                           loss_fn=lm_loss, optimizer=bench_optimizer, **placement(cfg)) as pipe:
            theirs = []
            for r in range(cfg.rounds):
                progress(f"  {name}: torch.distributed.pipelining and mpmd fit, round {r + 1} of {cfg.rounds}")
                t = measure_torch(cfg, name)
                a = measure_ahead(pipe, batches, cfg.warmup, cfg.steps)
                theirs += t
                ours["ahead"]["step"] += a
                rounds.append(statistics.median(t) / statistics.median(a))
    return {"mpmd": ours, "torch": theirs, "rounds": rounds, "profile": report}


def table_steps(cfg: BenchConfig, results: dict) -> list[str]:
    single = results["single"]
    rows = [("-", "single process (1 thread)", f"{single * 1e3:.1f}", "1.00x", "-", "-", "-", "-", "-")]
    notes = []
    for name, r in results["schedules"].items():
        ours, report = r["mpmd"], r["profile"]
        torch_step = statistics.median(r["torch"]) if r["torch"] else None
        med = {f: (statistics.median(ours[f]["step"]), statistics.median(ours[f]["dispatch"])) for f in MODES}
        for f in MODES:
            step, disp = med[f]
            sim = f"{report.predicted_step_seconds * 1e3:.1f}" if f == "step" else "-"
            rows.append((name, _LABELS[f], f"{step * 1e3:.1f}", f"{single / step:.2f}x",
                         f"{torch_step / step:.2f}x" if torch_step else "-", str(ours[f]["rpcs"][-1]),
                         f"{disp * 1e3:.3f}", f"{disp / step:.2%}", sim))
        ahead = statistics.median(ours["ahead"]["step"])
        paired = r.get("rounds") or []
        rows.append((name, "mpmd fit (1 step ahead)", f"{ahead * 1e3:.1f}", f"{single / ahead:.2f}x",
                     f"{statistics.median(paired):.2f}x" if paired else "-", str(ours["step"]["rpcs"][-1]),
                     "-", "-", "-"))
        if paired:
            notes.append(f"{name}: fit vs torch per round {ratios_text(paired)}; "
                         f"median {statistics.median(paired):.2f}x")
        if cfg.torch_pipelining:
            rows.append((name, "torch.distributed.pipelining", f"{torch_step * 1e3:.1f}" if torch_step else "n/a",
                         f"{single / torch_step:.2f}x" if torch_step else "-", "1.00x" if torch_step else "-",
                         "-", "-", "-", "-"))
        notes.append(f"{name}: per-task dispatch {med['none'][1] / med['step'][1]:.1f}x lower with fusion=step than "
                     f"none ({med['none'][1] / med['step-ray'][1]:.1f}x over Ray tasks); measured / simulated step time {med['step'][0] / report.predicted_step_seconds:.2f}; "
                     f"bubble {report.bubble_fraction:.3f} measured, {report.predicted_bubble_fraction:.3f} simulated")
    header = ("schedule", "runtime", "step ms", "speedup", "vs torch", "RPCs/step", "dispatch ms/step",
              "dispatch %", "simulated ms")
    nparams = sum(p.numel() for s in bench_model(cfg, 1)[0] for p in s.parameters())
    return ([f"Table 1: GPT ({nparams:,} parameters; d_model {cfg.d_model}, {cfg.n_layers} layers, seq "
             f"{cfg.seq_len}), batch {cfg.batch_size} = {cfg.microbatches} microbatches, {cfg.actors} processes "
             f"({_where(cfg)}); median of {cfg.steps} steps after {cfg.warmup} warm-up"]
            + format_table(header, rows)
            + ["speedup: over the single process; vs torch: throughput relative to torch.distributed.pipelining "
               "with the same schedule;",
               "fit (1 step ahead): steps issued as Pipeline.fit issues them, time between completions; torch: "
               f"free-running loop, time between step ends; the two alternate over {cfg.rounds} rounds and the fit "
               "row's vs torch is the median of the rounds' ratios",
               "simulated: schedules.simulate fed the task costs pipe.profile measured (fusion=step)"] + notes)


def _where(cfg: BenchConfig) -> str:
    if cfg.device == "cpu":
        return "CPU, gloo, 1 thread each"
    return (f"one CUDA device shared by the {cfg.actors} actors, gloo through pinned host memory; "
            f"torch.distributed.pipelining n/a on one GPU (Note [torch on one GPU])")


def table_dispatch(cfg: BenchConfig, scaling: list[tuple]) -> list[str]:
    header = ("microbatches", "fusion", "RPCs/step", "tasks/step", "dispatch ms/step", "dispatch us/task", "step ms")
    rows = [(str(m), f, str(rpcs), str(tasks), f"{d * 1e3:.3f}", f"{dt * 1e6:.2f}", f"{s * 1e3:.1f}")
            for m, f, rpcs, tasks, d, dt, s in scaling]
    return ([f"Table 2: controller dispatch per step, 1f1b on {cfg.actors} actors with Linear(4, 4) stages; "
             f"median of {cfg.dispatch_steps} steps"] + format_table(header, rows))


# Note [torch on one GPU]: torch.distributed.pipelining's ranks would need NCCL between
# processes on one GPU, which NCCL refuses, and gloo has no CUDA send/recv; on a one-GPU
# machine the torch rows are n/a and the table says why.
