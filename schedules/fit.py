"""Fitting the runtime terms of the cost model (Note [runtime costs] in ``costs.py``)
from timings, by least squares.  Pure Python.

``fit_link``: message seconds against bytes, ``seconds = latency + bytes / bandwidth``.
``fit_overhead``: task durations against what they compute,
``duration = overhead + scale * compute`` (``scale`` near 1 when the compute estimate is
right; what is left, per task, is the fixed cost of running one).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

__all__ = ["LinkFit", "OverheadFit", "fit_link", "fit_overhead", "line_fit"]


class LinkFit(NamedTuple):
    latency: float  # seconds per message
    bandwidth: float  # bytes per second (math.inf: no measurable cost per byte)
    residual: float  # root-mean-square error of the fit, seconds
    samples: int


class OverheadFit(NamedTuple):
    overhead: float  # seconds per task
    scale: float  # measured duration per unit of estimated compute
    residual: float
    samples: int


def line_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float]:
    """Ordinary least squares ``y = a + b x``: ``(a, b, rms residual)``.  With one distinct
    ``x`` the slope cannot be told and is 0 (``a``: the mean)."""
    n = len(xs)
    if n == 0 or n != len(ys):
        raise ValueError(f"line_fit needs as many x as y values, at least one; got {len(xs)} and {len(ys)}")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    a = my - b * mx
    rms = math.sqrt(sum((y - a - b * x) ** 2 for x, y in zip(xs, ys)) / n)
    return a, b, rms


def fit_link(samples: Sequence[tuple[float, float]]) -> LinkFit:
    """``samples``: ``(bytes, seconds)`` of single messages.  A negative latency or slope
    (noise) is clipped to 0 (infinite bandwidth) and the other term refitted."""
    if not samples:
        raise ValueError("fit_link needs at least one (bytes, seconds) sample")
    xs, ys = [float(b) for b, _ in samples], [float(s) for _, s in samples]
    lat, per_byte, rms = line_fit(xs, ys)
    if per_byte <= 0:
        lat, per_byte = max(0.0, sum(ys) / len(ys)), 0.0
    elif lat < 0:
        lat, per_byte = 0.0, sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
    rms = math.sqrt(sum((y - lat - per_byte * x) ** 2 for x, y in zip(xs, ys)) / len(xs))
    return LinkFit(lat, 1.0 / per_byte if per_byte > 0 else math.inf, rms, len(samples))


def fit_overhead(samples: Sequence[tuple[float, float]]) -> OverheadFit:
    """``samples``: ``(estimated compute seconds, measured duration seconds)`` of tasks."""
    if not samples:
        raise ValueError("fit_overhead needs at least one (compute, duration) sample")
    xs, ys = [float(c) for c, _ in samples], [float(d) for _, d in samples]
    a, b, rms = line_fit(xs, ys)
    if len(set(xs)) == 1:  # one compute value: all of the difference is overhead
        a, b = max(0.0, a - xs[0]), 1.0
    return OverheadFit(max(0.0, a), b, rms, len(samples))
