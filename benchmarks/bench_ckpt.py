"""``python -m mpmd bench ckpt``: what a checkpoint costs the controller, the old way (every
byte through the controller, ``ckpt_baseline.py``) against the sharded save and load (each
actor writes and reads its own stages, Note [sharded checkpoint] in
``mpmd/training/checkpoint.py``), blocking and asynchronous, in one run on the same actors.

For each model size: save and load wall time; the controller's CPU time (``time.process_time()``
deltas: every thread of the controller, Ray's driver threads included, less the memory
sampler's own thread); and the controller's peak resident-set growth (a thread reading
``/proc/self/statm`` every 2 ms), in MB and as a share of the checkpoint's bytes.  An
asynchronous save is timed to when ``save`` returns and to when the checkpoint is complete.
The operations alternate within each repeat (a slow spell on a shared machine falls on
both paths); medians are reported.

The model: one stage per actor, each a stack of square ``Linear`` layers without bias,
float32, trained one step with SGD (no momentum unless ``--momentum``: no optimizer state).
The stages are factories that the actors call (Note [stage factories] in ``actors/build.py``):
the controller holds only their structure on the meta device, so the memory measured is the
checkpoint path's alone and a large model fits.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import shutil
import statistics
import tempfile
import threading
import time
from typing import NamedTuple, Optional

import torch

from mpmd.pipeline import Pipeline
from mpmd.profiler import format_table
from .ckpt_baseline import old_load, old_save
from .harness import ensure_ray, rss_bytes

__all__ = ["HELP", "add_arguments", "run", "BigStage", "Measure", "ConfigResult", "measure_config", "format_results",
           "same_state", "PATHS"]

# (path, operation) in the order each repeat runs them.
PATHS = (("old", "save"), ("sharded", "save"), ("async", "save"), ("old", "load"), ("sharded", "load"))
_WIDTH = 4096
_MICROBATCHES = 4


class BigStage(torch.nn.Module):
    """``layers`` square ``Linear(width, width, bias=False)`` layers.  The bench passes it as a
    stage factory (``functools.partial(BigStage, width, layers)``): each actor builds its own
    stage and the controller keeps its structure on the meta device (Note [stage factories])."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def model_shape(params: float, stages: int) -> tuple[int, int]:
    """``(width, layers per stage)`` of ``stages`` stages holding about ``params`` parameters:
    layers of about ``_WIDTH`` wide, the width a multiple of 64."""
    per_stage = params / stages
    layers = max(1, round(per_stage / (_WIDTH * _WIDTH)))
    return max(64, 64 * round(math.sqrt(per_stage / layers) / 64)), layers


# -- measuring ---------------------------------------------------------------------------------------
class Measure(NamedTuple):
    wall_s: float
    cpu_s: float
    rss_bytes: int  # peak growth of the controller's resident set over its size at the start
    returned_s: float  # when the call returned (an asynchronous save completes later); = wall_s otherwise


class _Sampler:
    """Wall, controller CPU and peak RSS growth over a ``with`` block; ``mark()`` notes when
    the call returned."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s, self.own_cpu_s, self.returned = interval_s, 0.0, None
        self.start_rss = self.peak = 0  # set on entering
        self.t0 = self.cpu0 = 0.0
        self.result: Optional[Measure] = None  # on leaving
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-ckpt-rss", daemon=True)
        self.start_rss = self.peak = 0  # bytes, from __enter__ on
        self.t0 = self.cpu0 = 0.0  # wall and process CPU seconds at __enter__
        self.result: Optional[Measure] = None  # set by __exit__

    def __enter__(self) -> "_Sampler":
        gc.collect()
        self.start_rss = self.peak = rss_bytes()
        self._thread.start()
        self.t0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())
        self.own_cpu_s = time.thread_time()  # this thread's CPU, taken out of the controller's

    def mark(self) -> None:
        self.returned = time.perf_counter()

    def __exit__(self, *exc) -> None:
        end, cpu = time.perf_counter(), time.process_time()
        self.peak = max(self.peak, rss_bytes())
        self._stop.set()
        self._thread.join()
        returned = self.returned if self.returned is not None else end
        self.result = Measure(end - self.t0, cpu - self.cpu0 - self.own_cpu_s, self.peak - self.start_rss,
                              returned - self.t0)


def _run_op(pipe: Pipeline, path: str, op: str, directory: str) -> Measure:
    target = os.path.join(directory, path)
    if op == "save":
        shutil.rmtree(target, ignore_errors=True)  # not an overwrite: removing the old one is not timed
    with _Sampler() as sampler:
        if (path, op) == ("old", "save"):
            old_save(pipe.engine, target)
        elif (path, op) == ("old", "load"):
            old_load(pipe.engine, target)
        elif op == "load":
            pipe.load(target)
        elif path == "sharded":
            pipe.save(target)
        else:
            pending = pipe.save(target, blocking=False)
            sampler.mark()
            pending.result()
    return sampler.result


def _full_state(pipe: Pipeline) -> dict:
    """Every stage's checkpoint state (module, optimizer, scheduler) and the step count, pulled
    to the controller (only for the correctness check, on small models)."""
    engine = pipe.engine
    parts = engine.client.checkpoint_states(indices=range(engine.num_ranks))
    return {"step": engine.step_count, "stages": {int(s): st for part in parts for s, st in part.items()}}


def same_state(a, b) -> bool:
    """Exact equality of nested dicts / lists of tensors and plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape \
            and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    return a == b


def _check(pipe: Pipeline, directory: str, batch) -> dict[str, bool]:
    """Each checkpoint loaded by each path (after a step that moves the state away) gives back
    the state it was saved from."""
    reference = _full_state(pipe)
    checks = {}
    for name, loader in (("old", old_load), ("sharded", None)):
        for written in ("old", "sharded", "async"):
            pipe.step(*batch)
            target = os.path.join(directory, written)
            if loader is None:
                pipe.load(target)
            else:
                loader(pipe.engine, target)
            checks[f"{written} loaded by {name}"] = same_state(_full_state(pipe), reference)
    return checks


class ConfigResult(NamedTuple):
    params: int
    width: int
    layers: int
    actors: int
    ckpt_bytes: int
    optimizer: str
    measures: dict  # (path, op) -> list[Measure]
    checks: dict  # "<written> loaded by <loader>" -> bool (empty without check)


def measure_config(params: float, actors: int, repeats: int, directory: str, *, momentum: float = 0.0,
                   check: bool = False) -> ConfigResult:
    """Build the model of about ``params`` parameters on ``actors`` actors, train one step, and
    time every (path, operation) of ``PATHS`` ``repeats`` times, alternating; ``check``: then
    verify that every checkpoint loads, by either path, to the state it was saved from."""
    width, layers = model_shape(params, actors)
    stages = [functools.partial(BigStage, width, layers) for _ in range(actors)]  # built by the actors
    optimizer = functools.partial(torch.optim.SGD, lr=1e-3, momentum=momentum)
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(_MICROBATCHES, width, generator=gen), torch.randn(_MICROBATCHES, width, generator=gen))
    os.makedirs(directory, exist_ok=True)
    measures: dict = {key: [] for key in PATHS}
    pipe = Pipeline(stages, schedule="1f1b", num_microbatches=_MICROBATCHES, loss_fn=torch.nn.functional.mse_loss,
                    optimizer=optimizer, device="cpu")
    try:
        pipe.step(*batch)  # optimizer state (momentum buffers with --momentum), step count 1
        for _ in range(repeats):
            for path, op in PATHS:
                measures[(path, op)].append(_run_op(pipe, path, op, directory))
        sharded = os.path.join(directory, "sharded")
        ckpt_bytes = sum(os.path.getsize(os.path.join(sharded, f)) for f in os.listdir(sharded))
        checks = _check(pipe, directory, batch) if check else {}
    finally:
        pipe.shutdown()
        del pipe
        gc.collect()
    opt = f"SGD momentum={momentum}" if momentum else "SGD without momentum (no optimizer state)"
    return ConfigResult(actors * layers * width * width, width, layers, actors, ckpt_bytes, opt, measures, checks)


# -- reporting ---------------------------------------------------------------------------------------
def _median(ms: list, field: str) -> float:
    return statistics.median(getattr(m, field) for m in ms)


def format_results(results: list[ConfigResult]) -> list[str]:
    header = ["params", "ckpt MB", "path", "op", "wall s", "returns s", "ctrl CPU s", "ctrl RSS +MB", "% of ckpt"]
    rows = []
    for r in results:
        for path, op in PATHS:
            ms = r.measures[(path, op)]
            rss = _median(ms, "rss_bytes")
            returns = f"{_median(ms, 'returned_s'):.2f}" if path == "async" else "-"
            rows.append([f"{r.params / 1e6:.0f}M", f"{r.ckpt_bytes / 1e6:.0f}", path, op, f"{_median(ms, 'wall_s'):.2f}",
                         returns, f"{_median(ms, 'cpu_s'):.3f}", f"{rss / 1e6:.1f}", f"{100 * rss / r.ckpt_bytes:.1f}"])
    lines = format_table(header, rows)
    ratio_header = ["params", "save wall", "save CPU", "save RSS", "async returns", "async wall", "load wall",
                    "load CPU", "load RSS"]
    ratio_rows = []
    for r in results:
        def ratio(path: str, op: str, field: str, base_field: Optional[str] = None) -> str:
            base = _median(r.measures[("old", op)], base_field or field)
            return f"{_median(r.measures[(path, op)], field) / base:.3f}" if base > 0 else "-"

        ratio_rows.append([f"{r.params / 1e6:.0f}M", ratio("sharded", "save", "wall_s"),
                           ratio("sharded", "save", "cpu_s"), ratio("sharded", "save", "rss_bytes"),
                           ratio("async", "save", "returned_s", "wall_s"), ratio("async", "save", "wall_s"),
                           ratio("sharded", "load", "wall_s"), ratio("sharded", "load", "cpu_s"),
                           ratio("sharded", "load", "rss_bytes")])
    lines += ["", "sharded / old (async: against the old save's wall time; < 1 is better)"]
    lines += format_table(ratio_header, ratio_rows)
    checks = {f"{r.params / 1e6:.0f}M: {k}": ok for r in results for k, ok in r.checks.items()}
    if checks:
        bad = [k for k, ok in checks.items() if not ok]
        lines += ["", f"correctness: {len(checks) - len(bad)}/{len(checks)} loads gave back the saved state"
                  + (f"; WRONG: {', '.join(bad)}" if bad else "")]
    return lines


# -- the command ---------------------------------------------------------------------------------------
HELP = "checkpoint save/load: the old path through the controller against sharded (sync and async)"


def add_arguments(p) -> None:
    p.add_argument("--params", default="200e6,800e6",
                   help="model sizes in float32 parameters, comma-separated (smoke test: --params 25e6)")
    p.add_argument("--actors", type=int, default=4, help="actors (one stage each)")
    p.add_argument("--repeats", type=int, default=3, help="repeats of every operation per size (medians)")
    p.add_argument("--momentum", type=float, default=0.0, help="SGD momentum: > 0 adds a buffer per parameter")
    p.add_argument("--check", action="store_true", help="also check that every checkpoint loads to the saved state")
    p.add_argument("--dir", default=None, help="where to write the checkpoints (default: a new directory in /tmp)")
    p.set_defaults(run=run)


def run(args) -> int:
    try:
        sizes = [float(x) for x in str(args.params).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"bench ckpt: --params takes sizes such as 200e6,800e6, got {args.params!r}") from None
    if not sizes or min(sizes) <= 0 or args.actors < 1 or args.repeats < 1:
        raise SystemExit("bench ckpt: --params must be positive sizes, --actors and --repeats at least 1")
    largest = int(max(sizes) * 4 * (2 if args.momentum else 1))
    # an object store that holds a few of the old path's per-rank transfers
    ensure_ray(args.actors, object_store_bytes=max(1 << 30, 4 * largest // args.actors))
    root = args.dir or tempfile.mkdtemp(prefix="mpmd-bench-ckpt-")
    results = []
    try:
        for params in sizes:
            print(f"[bench ckpt] {params / 1e6:.0f}M parameters on {args.actors} actors ...", flush=True)
            directory = os.path.join(root, f"p{int(params)}")
            try:
                results.append(measure_config(params, args.actors, args.repeats, directory,
                                              momentum=args.momentum, check=args.check))
            finally:
                shutil.rmtree(directory, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"\nCheckpoint save/load on {args.actors} actors (CPU), float32, {results[0].optimizer}, one stage per "
          f"actor; median of {args.repeats}; files in {root}")
    for r in results:
        print(f"  {r.params / 1e6:.0f}M: each stage {r.layers} x Linear({r.width}, {r.width}, bias=False)")
    print("ctrl CPU: the controller's process time (Ray's driver threads included); ctrl RSS: its peak growth")
    print("\n".join(format_results(results)))
    return 0
