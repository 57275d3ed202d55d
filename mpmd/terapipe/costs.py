"""TeraPipe's slice lengths: given, uniform, or planned from measured slice costs.

``token_slices``: ``"auto"`` measures one slice's time over a few (length, context)
points on this process's device (on CPU with an actor's thread count, ``num_cpus``),
fits ``schedules.slicing.CostModel`` and solves ``schedules.slicing.plan_slices``; an
int gives that many near-equal slices; a list gives the slice lengths; a callable
``cost(length, context) -> seconds`` is planned with directly.  The measurement sees
compute only: ``slice_overhead=`` seconds adds the runtime's per-slice transfer and
dispatch cost to every slice (it matters on CPU/gloo, where a hop costs about as much
as a small slice's compute).  With ``"auto"`` and no ``slice_overhead`` this plan is
provisional: the pipeline measures the overhead on its actors and plans again
(``calibrate.py``).  ``slice_granularity`` (default: the smallest divisor of
``seq_len`` giving at most 32 units) is the multiple every planned slice length is.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from schedules.slicing import CostModel, SlicePlan, plan_slices, uniform_slices

from .protocol import first_stage_attribute, token_slice

__all__ = ["TokenSlices", "measure_slice_costs", "fit_slice_cost", "resolve_token_slices", "default_granularity",
           "with_overhead"]

TokenSlices = Union[str, int, Sequence[int], Callable[[int, int], float]]


def default_granularity(seq_len: int, max_units: int = 32) -> int:
    """The smallest divisor ``g`` of ``seq_len`` with at most ``max_units`` slices of ``g`` tokens."""
    return next(g for g in range(1, seq_len + 1) if seq_len % g == 0 and seq_len // g <= max_units)


def resolve_token_slices(token_slices: TokenSlices, stages: Sequence[torch.nn.Module], *,
                         seq_len: Optional[int] = None, granularity: Optional[int] = None,
                         device: str = "cpu", num_threads: Optional[int] = 1,
                         slice_overhead: Optional[float] = None
                         ) -> tuple[tuple[int, ...], Optional[SlicePlan], Optional[Callable]]:
    """Slice lengths for ``token_slices``; returns (slices, plan or None, cost function or None).

    ``slice_overhead`` (seconds; None: 0) is added to every slice's planned cost: the runtime's
    per-slice transfers and dispatch, which the in-process measurement does not see.  The
    cost function returned is the one planned with, overhead included.
    """
    slice_overhead = 0.0 if slice_overhead is None else slice_overhead
    if not isinstance(slice_overhead, (int, float)) or isinstance(slice_overhead, bool) \
            or not 0 <= slice_overhead < float("inf"):
        raise ValueError(f"slice_overhead must be a finite number of seconds >= 0, got {slice_overhead!r}")
    if isinstance(token_slices, (list, tuple)):
        bad = [x for x in token_slices if not isinstance(x, int) or isinstance(x, bool) or x < 1]
        if not token_slices or bad:
            raise ValueError(f"token_slices must be positive slice lengths, got {list(token_slices)!r}")
        if seq_len is not None and sum(token_slices) != seq_len:
            raise ValueError(f"token_slices {list(token_slices)} add up to {sum(token_slices)} tokens, "
                             f"but seq_len={seq_len}; make them add up to {seq_len}")
        return tuple(token_slices), None, None
    seq_len = seq_len if seq_len is not None else first_stage_attribute(stages, "max_seq_len")
    if seq_len is None:
        raise ValueError("cannot tell the sequence length from the stages; pass seq_len=... "
                         "or token_slices as a list of slice lengths (or give the first stage a max_seq_len)")
    g = granularity if granularity is not None else default_granularity(seq_len)
    if isinstance(token_slices, int) and not isinstance(token_slices, bool):
        return uniform_slices(seq_len, token_slices, g), None, None
    if token_slices == "auto":
        if any(p.is_meta for stage in stages for p in stage.parameters()):
            raise ValueError("token_slices='auto' times the whole model on this process, but the stages are built "
                             "by the actors (stage factories); pass token_slices as a number of slices, a list of "
                             "slice lengths or a cost(length, context) function")
        cost = fit_slice_cost(stages, seq_len, granularity=g, device=device, num_threads=num_threads)
    elif callable(token_slices):
        cost = token_slices
    else:
        raise ValueError(f"token_slices must be 'auto', a number of slices, a list of slice lengths or a "
                         f"cost(length, context) function, got {token_slices!r}")
    if slice_overhead:
        cost = with_overhead(cost, float(slice_overhead))
    plan = plan_slices(seq_len, len(stages), cost, g)
    return plan.slices, plan, cost


def fit_slice_cost(stages: Sequence[torch.nn.Module], seq_len: int, *, granularity: int = 1,
                   device: str = "cpu", repeats: int = 3,
                   num_threads: Optional[int] = 1) -> Callable[[int, int], float]:
    """Measure a stage's slice time on a grid of (length, context) points and fit the
    paper's ``a0 + a1*l + a2*c + a3*l*c``.

    Lengths run geometrically from one ``granularity`` unit to half the sequence, so the
    fixed per-slice cost ``a0`` (what stops the planner from cutting ever finer) is pinned
    by measurements of the smallest slices rather than extrapolated.  The fit is floored
    at the cheapest measured slice: no slice costs less than one unit without context.
    """
    g, units = granularity, seq_len // granularity
    lengths, n = [], 1
    while n <= max(1, units // 2):
        lengths.append(n * g)
        n *= 2
    contexts = sorted({round(units * f) * g for f in (0, 1 / 4, 1 / 2, 3 / 4)})
    points = [(l, c) for l in lengths for c in contexts if l + c <= seq_len]
    samples = measure_slice_costs(stages, points, device=device, repeats=repeats, num_threads=num_threads)
    return _Clamped(CostModel.fit(samples), max(min(t for _, _, t in samples), 1e-12))


def with_overhead(cost: Callable[[int, int], float], overhead: float) -> Callable[[int, int], float]:
    """``cost`` plus ``overhead`` seconds for every slice."""
    return _WithOverhead(cost, overhead) if overhead else cost


class _WithOverhead:
    def __init__(self, cost: Callable[[int, int], float], overhead: float) -> None:
        self.cost, self.overhead = cost, overhead

    def __call__(self, length: int, context: int) -> float:
        return self.cost(length, context) + self.overhead

    def __repr__(self) -> str:
        return f"{self.cost!r} + {self.overhead:.3g}"


class _Clamped:
    def __init__(self, model: CostModel, floor: float) -> None:
        self.model, self.floor = model, floor

    def __call__(self, length: int, context: int) -> float:
        return max(self.model(length, context), self.floor)

    def __repr__(self) -> str:
        return f"max({self.model!r}, {self.floor:.3g})"


def measure_slice_costs(stages: Sequence[torch.nn.Module], points: Sequence[tuple[int, int]], *,
                        device: str = "cpu", repeats: int = 3, batch: int = 1,
                        num_threads: Optional[int] = 1) -> list[tuple[int, int, float]]:
    """``(length, context, seconds)``: forward plus backward of one slice of ``length`` tokens
    after ``context`` tokens, on the slowest stage (fastest of ``repeats``).  On CPU it runs
    with ``num_threads`` threads, as an actor with that many CPUs does (Ray sets
    ``OMP_NUM_THREADS`` to an actor's ``num_cpus``)."""
    threads = torch.get_num_threads()
    if device == "cpu" and num_threads:
        torch.set_num_threads(num_threads)
    try:
        return _measure(stages, points, torch.device(device), repeats, batch)
    finally:
        torch.set_num_threads(threads)


def _measure(stages, points, dev: torch.device, repeats: int, batch: int) -> list[tuple[int, int, float]]:
    vocab = first_stage_attribute(stages, "vocab_size")
    if vocab is None:
        raise ValueError("token_slices='auto' measures slices on random token ids, but the first stage does not tell "
                         "its vocab_size; give it a vocab_size attribute, or pass token_slices as a number of slices, "
                         "slice lengths or a cost(length, context) function")
    copies = [copy.deepcopy(s).to(dev) for s in stages]
    gen = torch.Generator().manual_seed(0)
    out = []
    for length, context in points:
        ids = torch.randint(0, vocab, (batch, context + length), generator=gen).to(dev)
        times = [_time_slice(copies, ids, context, dev) for _ in range(repeats + 1)][1:]  # first is warm-up
        per_stage = [min(t[s] for t in times) for s in range(len(copies))]  # load only adds time
        out.append((length, context, max(per_stage)))
    for s in copies:
        s.reset_contexts()
    return out


def _time_slice(stages: list, ids: torch.Tensor, context: int, dev: torch.device) -> list[float]:
    for s in stages:
        s.reset_contexts()
    if context:
        value: Any = token_slice(ids[:, :context], 0, 0)
        for s in stages:
            value = _detached(s(value))
    value = token_slice(ids[:, context:], 0, context)
    value = {k: v.to(dev) for k, v in value.items()}
    elapsed = []
    for s in stages:
        t0 = _now(dev)
        out = s(value)
        y = out["x"] if isinstance(out, dict) else out
        torch.autograd.backward([y], [torch.ones_like(y)])
        elapsed.append(_now(dev) - t0)
        value = _detached(out)
    return elapsed


def _detached(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v)
                for k, v in value.items()}
    return value.detach()


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()
