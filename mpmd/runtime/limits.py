"""The limits every number of a configuration is held to (Note [numeric limits]): each
maximum with why it is there, and ``IntRange`` / ``FloatRange``, which check one option and
name it.  ``PipelineConfig`` (config.py) and the LM config (mpmd/lm/config.py) use them."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

__all__ = ["IntRange", "FloatRange", "MAX_MICROBATCHES", "MAX_SEED", "MAX_ACTORS", "MAX_TIMEOUT_S", "MAX_MEMORY_BYTES",
           "MAX_BUCKET_BYTES"]

# Note [numeric limits]
# Every number of a configuration is checked before anything starts.  A float must be finite:
# NaN compares False with everything, so a check written ``if x <= 0: raise`` lets it through,
# and it then reaches the actors (a NaN learning rate writes a NaN checkpoint).  An integer must
# be an int, not a bool (``True`` is an int to Python), in a range whose maximum is far above
# any real run yet low enough that what is built from the value before the first step (a
# schedule lists every microbatch's actions; Ray is asked for every actor) takes seconds, not a
# day.  ``IntRange`` and ``FloatRange`` check one option each and name it; the LM config
# (mpmd/lm/config.py) declares one per numeric key with these maxima.

# per replica and step.  A schedule holds every microbatch's actions on every rank; it is built,
# lowered and simulated before the first step (and by --dry-run): about 5 s to build and 40 s to
# dry-run at 65,536 for 2 stages on a 2-core machine, a day at 10**9.  Real runs use 4-8 per stage.
MAX_MICROBATCHES = 65_536
# numpy's legacy seeding takes [0, 2**32); stage_seed(seed, s) = seed * 1_000_003 + s (actors/build.py)
# then stays far below torch.manual_seed's 2**64.
MAX_SEED = 2 ** 32 - 1
# devices of one pipeline (actors x dp x tp, spare actors): 4x the largest clusters reported for one
# training run (16,384 GPUs for Llama 3 405B); Ray is asked for each.
MAX_ACTORS = 65_536
# a week: a longer timeout is no limit in effect, and the actors' deadlines (datetime.timedelta) need
# a number they can hold.
MAX_TIMEOUT_S = 7 * 24 * 3600.0
MAX_MEMORY_BYTES = 2 ** 50  # per actor: 1 PiB, 8,000x an H200's 141 GB
MAX_BUCKET_BYTES = 2 ** 40  # 1 TiB: every real model's gradients fit in one bucket below it


@dataclasses.dataclass(frozen=True)
class IntRange:
    """An integer option's range, ``low`` to ``high`` inclusive (None allowed with ``optional``);
    ``why`` says what the maximum protects (Note [numeric limits])."""

    low: int
    high: int
    why: str = ""
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        """``value`` in range, or a ``ValueError`` naming ``name`` and the range."""
        if value is None and self.optional:
            return
        if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value > self.high:
            raise ValueError(f"{name} = {_shown(value)} is more than the maximum {self.high:,}"
                             f"{': ' + self.why if self.why else ''}")
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < self.low:
            raise ValueError(f"{name} must be {self}{' or None' if self.optional else ''}, got {_shown(value)}")

    def __str__(self) -> str:
        kind = {0: "an integer >= 0", 1: "a positive integer"}.get(self.low, f"an integer >= {self.low:,}")
        return f"{kind} (at most {self.high:,})"

    @property
    def span(self) -> str:
        """The range in short: "1 to 65,536"."""
        return f"{self.low:,} to {self.high:,}"


@dataclasses.dataclass(frozen=True)
class FloatRange:
    """A float option's range: finite (``inf_ok``: +inf too), above ``low`` (included unless
    ``low_open``), at most ``high`` (excluded with ``high_open``); None allowed with ``optional``."""

    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    inf_ok: bool = False
    why: str = ""
    optional: bool = False

    def check(self, name: str, value: Any) -> None:
        """``value`` finite and in range, or a ``ValueError`` naming ``name`` and the range."""
        if value is None and self.optional:
            return
        real = isinstance(value, numbers.Real) and not isinstance(value, bool)
        finite = real and (isinstance(value, numbers.Integral) or math.isfinite(value))  # a huge int has no float
        if not (finite or (real and self.inf_ok and value == math.inf)):
            raise ValueError(f"{name} must be {self}{' or None' if self.optional else ''}, got {_shown(value)}")
        if value > self.high and self.why and finite:
            raise ValueError(f"{name} = {_shown(value)} is more than the maximum {_number(self.high)}: {self.why}")
        below = value <= self.low if self.low_open else value < self.low
        above = value >= self.high if self.high_open else value > self.high
        if below or above:
            raise ValueError(f"{name} must be {self}{' or None' if self.optional else ''}, got {_shown(value)}")

    def __str__(self) -> str:
        kind = "a number" if self.inf_ok else "a finite number"
        return f"{kind}{' in' if self.span.startswith(('(', '[')) else ''} {self.span}"

    @property
    def span(self) -> str:
        """The range in short: "> 0", "[0, 1)", "> 0 or inf"."""
        if math.isinf(self.high):
            text = f"{'>' if self.low_open else '>='} {_number(self.low)}"
            return text + (" or inf" if self.inf_ok else "")
        return (f"{'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                f"{')' if self.high_open else ']'}")


def _shown(value: Any) -> str:
    """``value`` for a message, a huge integer cut short: 1,000,000,000 or 10000000000...(401 digits)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        text = f"{value:,}"
        return text if len(text) <= 40 else f"{str(value)[:12]}...({len(str(abs(value)))} digits)"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _number(x: float) -> str:
    """``x`` for a message: 604,800, 0.5 or 2**-20."""
    if float(x).is_integer() and abs(x) < 1e18:
        return f"{x:,.0f}"
    mantissa, exponent = math.frexp(x)
    return f"2**{exponent - 1}" if mantissa == 0.5 and exponent < -9 else f"{x:g}"
