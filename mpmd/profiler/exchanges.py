"""The expert all-to-alls of a profile (``ProfileReport.all_to_all``) and how much of each was
hidden behind compute (``ProfileReport.all_to_all_hiding``).

Note [hidden all-to-all]
~~~~~~~~~~~~~~~~~~~~~~~~
An actor records, per exchange (``actors.exchange.ExchangeLog``), when it was issued, when the
issuing side began to be held up by it, and when its wait returned.  Alone (a forward or a
backward by itself) the side waits right after issuing it, so all of its time in flight is
blocked.  Inside an ``OVERLAP`` (Note [overlap turns] in actors/overlap.py) the side hands the
baton to the other side, which computes until its own next exchange or its end, and only then
waits: the time from issue to getting the baton back is in flight but not blocked, i.e. hidden
behind the other side's compute.  So, per exchange,

    in flight = end - issued,   blocked = end - start,   hidden = start - issued >= 0,

and ``in flight = blocked + hidden`` exactly.  ``blocked`` is the ``A2A`` slice (what
``all_to_all_seconds`` sums); the simulator's counterparts are ``SimResult.all_to_all`` (blocked)
and ``all_to_all_hidden`` (Note [all-to-all costs] in schedules/costs.py).  "In flight" is the
host's view: on CUDA with NCCL a wait returns once the exchange is queued on the stream.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable, NamedTuple, Sequence

from .slices import A2A, Slice

__all__ = ["A2AHiding", "exchange_slices", "hiding_lines"]


class A2AHiding(NamedTuple):
    """One actor's expert all-to-alls in one profiled step (seconds; Note [hidden all-to-all])."""

    actor: int
    step: int  # index among the profiled steps
    exchanges: int
    in_flight_s: float  # from each exchange's issue to its wait's return, summed
    blocked_s: float  # of that, the issuing side held up (the A2A slices)
    hidden_s: float  # the rest: the other side of an overlap computed meanwhile

    @property
    def hidden_fraction(self) -> float:
        return self.hidden_s / self.in_flight_s if self.in_flight_s > 0 else 0.0


def exchange_slices(records: Sequence, programs: list, num_ranks: int,
                    offsets_ns: Sequence[int]) -> tuple[tuple[Slice, ...], tuple[A2AHiding, ...]]:
    """The expert all-to-alls of every profiled step (``StepRecord.exchanges``), as ``A2A``
    slices of their blocked spans on the controller's clock, and per actor and step what of
    them was in flight, blocked and hidden."""
    out = []
    totals: dict[tuple[int, int], list] = defaultdict(lambda: [0, 0, 0])  # (actor, step) -> count, flight, blocked ns
    for k, rec in enumerate(records):
        for a, spans in enumerate(rec.exchanges or ()):
            for idx, t0, t1, what, *issued in spans:
                out.append(Slice(a, k, idx, f"{programs[a % num_ranks][idx]!r} {what}", A2A,
                                 t0 - offsets_ns[a], t1 - offsets_ns[a]))
                sent = min(issued[0], t0) if issued else t0  # a record without its issue time: all blocked
                total = totals[(a, k)]
                total[0] += 1
                total[1] += t1 - sent
                total[2] += t1 - t0
    hiding = tuple(A2AHiding(a, k, n, flight * 1e-9, blocked * 1e-9, (flight - blocked) * 1e-9)
                   for (a, k), (n, flight, blocked) in sorted(totals.items()))
    return tuple(out), hiding


def hiding_lines(hiding: Sequence[A2AHiding], labels: Sequence[str],
                 format_table: Callable[[tuple, list], list[str]]) -> list[str]:
    """The report's table (``format_table``: report.py's) of the all-to-alls hidden, per actor
    and step (none without any)."""
    if not hiding:
        return []
    rows = [(labels[h.actor] if h.actor < len(labels) else str(h.actor), str(h.step), str(h.exchanges),
             f"{h.in_flight_s * 1e3:.2f}", f"{h.blocked_s * 1e3:.2f}", f"{h.hidden_s * 1e3:.2f}",
             f"{h.hidden_fraction:.1%}") for h in hiding]
    return ["", "expert all-to-alls per actor and step (Note [hidden all-to-all]: hidden = in flight - blocked)"] + \
        format_table(("actor", "step", "exchanges", "in flight ms", "blocked ms", "hidden ms", "hidden %"), rows)
