"""TeraPipe token-slicing planner (Li et al., ICML 2021), pure standard library.

A sequence of ``seq_len`` tokens is cut into slices that flow through a
``num_stages``-deep pipeline.  With per-slice times ``t_i`` the pipeline
latency is ``T = sum_i t_i + (K - 1) * max_i t_i``; :func:`plan_slices`
finds slice lengths minimising ``T`` exactly.  The schedules that run the slices
are built by ``token_sliced.py`` (registered as ``terapipe``).  ``t_i`` must hold
everything a slice costs: a runtime adds a fixed per-slice overhead ``o`` to each
(``T`` grows by ``(n + K - 1) * o`` for ``n`` slices), which ``mpmd.terapipe``
measures on the actors (Note [calibrated slices] in ``mpmd/terapipe/calibrate.py``).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

__all__ = ["SlicePlan", "CostModel", "plan_slices", "uniform_slices", "slicing_time"]

CostFn = Callable[[int, int], float]
_INF = math.inf


@dataclass(frozen=True)
class SlicePlan:
    """Optimal slicing: pipeline latency and slice lengths in sequence order."""

    total_time: float
    slices: tuple[int, ...]


def _positive_int(name: str, value: int) -> int:
    value = operator.index(value)
    if value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value}")
    return value


def _check_divisible(seq_len: int, granularity: int) -> None:
    if seq_len % granularity:
        divisors = [d for d in range(1, seq_len + 1) if seq_len % d == 0][:10]
        padded = -(-seq_len // granularity) * granularity
        raise ValueError(
            f"seq_len={seq_len} is not divisible by granularity={granularity}; "
            f"use a granularity that divides {seq_len} (e.g. {', '.join(map(str, divisors))}) "
            f"or pad the sequence to {padded} tokens"
        )


def _checked_cost(cost: CostFn, length: int, context: int) -> float:
    value = float(cost(length, context))
    if not math.isfinite(value) or value < 0:
        raise ValueError(
            f"cost({length}, {context}) returned {value!r}; cost must return a finite, "
            "non-negative time"
        )
    return value


def _dp(cols: list[list[tuple[float, int]]], t_max: float) -> tuple[float, list[int]]:
    """Min total slice time using only slices costing <= t_max; returns (f(n), parents)."""
    n = len(cols) - 1
    f = [_INF] * (n + 1)
    parent = [-1] * (n + 1)
    f[0] = 0.0
    for end in range(1, n + 1):
        best, arg = _INF, -1
        for c, start in cols[end]:  # sorted by cost, so stop at the first too-slow slice
            if c > t_max:
                break
            v = f[start] + c
            if v < best:
                best, arg = v, start
        f[end], parent[end] = best, arg
    return f[n], parent


def plan_slices(
    seq_len: int, num_stages: int, cost: CostFn, granularity: int = 1
) -> SlicePlan:
    """Minimise ``sum t_i + (num_stages - 1) * max t_i`` over slicings of ``seq_len``.

    ``cost(length, context)`` is the time of a slice of ``length`` tokens that
    attends to ``context`` earlier tokens.  Slice lengths are multiples of
    ``granularity``.
    """
    seq_len = _positive_int("seq_len", seq_len)
    num_stages = _positive_int("num_stages", num_stages)
    granularity = _positive_int("granularity", granularity)
    _check_divisible(seq_len, granularity)
    n, g, k1 = seq_len // granularity, granularity, num_stages - 1

    # cols[end] holds (cost, start) for every slice [start, end) in grid units,
    # sorted by cost so each inner DP can cut off at t_max with a break.
    cols: list[list[tuple[float, int]]] = [[]]
    for end in range(1, n + 1):
        cols.append(
            sorted((_checked_cost(cost, (end - start) * g, start * g), start) for start in range(end))
        )

    free_sum, best_parent = _dp(cols, _INF)
    if k1 > 0:
        # Smallest t_max admitting any slicing (min over paths of the max slice);
        # cheaper candidates are infeasible and need not be tried.
        bottleneck = [_INF] * (n + 1)
        bottleneck[0] = 0.0
        for end in range(1, n + 1):
            bottleneck[end] = min(max(bottleneck[s], c) for c, s in cols[end])
        candidates = sorted({c for col in cols for c, _ in col if c >= bottleneck[n]})
        best_total = _INF
        for t_max in candidates:
            # f(L) never drops below the unconstrained optimum, so this bounds T(t_max).
            if k1 * t_max + free_sum >= best_total:
                break
            f_n, parent = _dp(cols, t_max)
            if f_n + k1 * t_max < best_total:
                best_total, best_parent = f_n + k1 * t_max, parent

    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(best_parent[bounds[-1]])
    bounds.reverse()
    slices = tuple((b - a) * g for a, b in zip(bounds, bounds[1:]))
    times = [_checked_cost(cost, length, a * g) for length, a in zip(slices, bounds)]
    # Report the exact objective of the chosen slices (same summation as slicing_time).
    return SlicePlan(total_time=sum(times) + k1 * max(times), slices=slices)


def uniform_slices(seq_len: int, num_slices: int, granularity: int = 1) -> tuple[int, ...]:
    """Split ``seq_len`` into ``num_slices`` near-equal multiples of ``granularity``."""
    seq_len = _positive_int("seq_len", seq_len)
    num_slices = _positive_int("num_slices", num_slices)
    granularity = _positive_int("granularity", granularity)
    _check_divisible(seq_len, granularity)
    units = seq_len // granularity
    if num_slices > units:
        raise ValueError(
            f"cannot split seq_len={seq_len} into {num_slices} non-empty slices of granularity "
            f"{granularity}; at most {units} slices are possible"
        )
    base, rem = divmod(units, num_slices)
    return tuple((base + (i < rem)) * granularity for i in range(num_slices))


def slicing_time(slices: Sequence[int], num_stages: int, cost: CostFn) -> float:
    """Pipeline latency ``sum t_i + (num_stages - 1) * max t_i`` of the given slices."""
    num_stages = _positive_int("num_stages", num_stages)
    if not slices:
        raise ValueError("slices must contain at least one slice")
    times, context = [], 0
    for length in slices:
        length = _positive_int("every slice length", length)
        times.append(_checked_cost(cost, length, context))
        context += length
    return sum(times) + (num_stages - 1) * max(times)


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting; raises ValueError if singular."""
    size = len(rhs)
    a = [row[:] + [b] for row, b in zip(matrix, rhs)]
    tol = 1e-10 * max(abs(a[i][i]) for i in range(size))
    for col in range(size):
        pivot = max(range(col, size), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= tol:
            raise ValueError(
                "cost samples do not determine the model (singular normal equations); "
                "measure more distinct (length, context) pairs, varying both length and context"
            )
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, size):
            factor = a[r][col] / a[col][col]
            for j in range(col, size + 1):
                a[r][j] -= factor * a[col][j]
    x = [0.0] * size
    for r in reversed(range(size)):
        x[r] = (a[r][size] - sum(a[r][j] * x[j] for j in range(r + 1, size))) / a[r][r]
    return x


@dataclass(frozen=True)
class CostModel:
    """Slice time ``a0 + a1*length + a2*context + a3*length*context``."""

    a0: float
    a1: float
    a2: float
    a3: float

    def __call__(self, length: int, context: int) -> float:
        return self.a0 + self.a1 * length + self.a2 * context + self.a3 * length * context

    @classmethod
    def fit(cls, samples: Iterable[tuple[int, int, float]]) -> "CostModel":
        """Least-squares fit to ``(length, context, seconds)`` measurements."""
        rows = [(1.0, float(l), float(c), float(l) * float(c), float(t)) for l, c, t in samples]
        if len(rows) < 4:
            raise ValueError(
                f"CostModel.fit needs at least 4 (length, context, seconds) samples, got "
                f"{len(rows)}; measure more distinct (length, context) pairs"
            )
        # Scale each feature to max |value| 1 so the length*context column (huge
        # for long sequences) does not swamp the pivot tolerance.
        scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(4)]
        xs = [[r[j] / scale[j] for j in range(4)] for r in rows]
        normal = [[sum(x[i] * x[j] for x in xs) for j in range(4)] for i in range(4)]
        rhs = [sum(x[i] * r[4] for x, r in zip(xs, rows)) for i in range(4)]
        beta = _solve(normal, rhs)
        return cls(*(b / s for b, s in zip(beta, scale)))
