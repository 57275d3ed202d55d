"""What the benchmarks (``python -m mpmd bench NAME``) share: a local Ray for them
(``mpmd.runtime.devices.ensure_ray``), the demo's text, timed calls, pipelines kept alive
together and timed in alternating rounds, paired ratios, text tables, and this process's
resident size.

Note [alternating rounds]: the machine a bench runs on is often shared, and its load
swings by tens of percent within a minute.  A bench that compares configurations keeps
them all alive at once and lets them take turns, a few steps each, round after round; a
slow spell then falls on every configuration alike, and medians (or the median of paired
ratios) over the rounds compare like with like.
"""

from __future__ import annotations

import importlib.resources
import os
import random
import statistics
import sys
import time
from typing import Any, Callable, Hashable, Iterable, Mapping, NamedTuple, Optional, Sequence, Union

from mpmd.profiler import format_table
from mpmd.runtime.devices import ensure_ray

__all__ = ["ensure_ray", "demo_text", "progress", "timed", "PipelineSet", "Rounds", "time_rounds", "median_ratio",
           "ratios_text", "print_table", "rss_bytes", "step_memory"]


def demo_text() -> str:
    """The demo's text (``mpmd/cli/data/pipeline.txt``), which the bench GPTs train on: read as
    package data, as ``mpmd/lm/data.py`` reads its corpora, since the CLI imports the benches
    and not the other way round."""
    return importlib.resources.files("mpmd.cli").joinpath("data/pipeline.txt").read_text()


def progress(msg: str) -> None:
    """A bench's progress line, on stderr (its tables go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def timed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """Seconds one call of ``fn`` takes."""
    t0 = time.perf_counter()
    fn(*args, **kwargs)
    return time.perf_counter() - t0


class PipelineSet(dict):
    """Pipelines by key, alive together; leaving the ``with`` block shuts every one down."""

    def __enter__(self) -> "PipelineSet":
        return self

    def __exit__(self, *exc) -> None:
        for pipe in self.values():
            pipe.shutdown()


class Rounds(NamedTuple):
    seconds: dict  # key -> the timed steps' seconds, in the order run
    losses: dict  # key -> the timed steps' losses


Batches = Union[Sequence[tuple], Callable[[Hashable], Sequence[tuple]]]


def time_rounds(pipes: Mapping[Hashable, Any], batches: Batches, rounds: int, *,
                shuffle: Optional[random.Random] = None, untimed_first: bool = False,
                progress: Callable[[str], None] = lambda msg: None) -> Rounds:
    """Alternating rounds (Note [alternating rounds]): each round, every pipeline in turn
    steps through its batches, each step timed.  ``batches``: a list of ``(inputs, targets)``
    for every pipeline, or a function of the key giving one.  ``shuffle``: a random source
    that reorders the turns every round (no pipeline always runs right after the same other
    one); ``untimed_first``: each turn first runs its first batch untimed (back from another
    pipeline's turn)."""
    seconds: dict = {k: [] for k in pipes}
    losses: dict = {k: [] for k in pipes}
    order = list(pipes)
    for r in range(rounds):
        if shuffle is not None:
            shuffle.shuffle(order)
        progress(f"  round {r + 1}/{rounds}")
        for key in order:
            pipe, mine = pipes[key], batches(key) if callable(batches) else batches
            if untimed_first:
                pipe.step(*mine[0])
            for x, y in mine:
                t0 = time.perf_counter()
                losses[key].append(pipe.step(x, y))
                seconds[key].append(time.perf_counter() - t0)
    return Rounds(seconds, losses)


def median_ratio(numerators: Iterable[float], denominators: Iterable[float]) -> float:
    """The median of paired ratios (each pair measured back to back: Note [alternating rounds])."""
    return statistics.median(a / b for a, b in zip(numerators, denominators))


def ratios_text(ratios: Iterable[float]) -> str:
    """``"1.02x, 0.97x"``: ratios as a bench prints them."""
    return ", ".join(f"{q:.2f}x" for q in ratios)


def print_table(header: Sequence[str], rows: Sequence[Sequence[str]], log: Callable[[str], None] = print) -> None:
    """A text table, columns aligned (the first left, the others right)."""
    for line in format_table(header, rows):
        log(line)


def step_memory(pipe: Any, *args: Any, **side: Any) -> tuple[list[dict], list[dict]]:
    """Each actor's ``memory_stats`` just before one ``pipe.step(*args, **side)`` (heap trimmed,
    peak restarted) and after it: ``after[i]["peak_rss_bytes"] - before[i]["rss_bytes"]`` is what
    the step added at its peak on actor ``i`` (the kernel's VmHWM)."""
    before = pipe.engine.client.memory_stats(reset=True, what="memory")
    pipe.step(*args, **side)
    return before, pipe.engine.client.memory_stats(what="memory")


def rss_bytes() -> int:
    """This process's resident size now (Linux: ``/proc/self/statm``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
