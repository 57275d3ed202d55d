"""Each actor's peak memory under a schedule: the accounting ``schedule="auto"``, the dry run
of ``mpmd train`` and ``python -m mpmd bench peaks`` share (Note [memory phases] and Note
[recomputed phases] in phases.py say where its terms come from)."""

from __future__ import annotations

from typing import NamedTuple

from schedules import PREFETCH, Kind

from .costs import StageCost

__all__ = ["rank_memory"]


def rank_memory(sched, costs: list[StageCost], optimizer_state_factor: float, tp: int = 1) -> list[float]:
    """Per rank: parameter, gradient and optimizer bytes (one TP rank's) plus the peak live
    activation bytes (whole: Note [TP cost model] in tp.py).  A recomputed stage holds its
    input and output per microbatch in flight, and its recomputed activations during its
    backward: while ``B`` runs, or from ``I`` to ``W`` (Note [recompute at I] in actors/stage_exec.py); where its
    recomputed phases were measured, what they measured (Note [recomputed phases] in
    phases.py); and the receives it posts ahead, ``PREFETCH`` of its largest (Note [receive
    prefetch] in actors/transfers.py)."""
    phases = {(s, split): _Phases.of(c, split) for s, c in enumerate(costs) for split in (False, True)}
    owner = {s: r for r in range(sched.num_ranks) for s in sched.stages_of(r)}
    out = []
    for r, acts in enumerate(sched.ranks):
        mine = sched.stages_of(r)
        received = sorted([costs[s].in_bytes for s in mine if s > 0 and owner[s - 1] != r]
                          + [costs[s].out_bytes for s in mine if s + 1 < len(costs) and owner[s + 1] != r])
        live = peak = 0.0
        for a, beside in _beside(acts, costs):
            c = phases[(a.stage, sched.backward_of(a.stage, a.microbatch) is Kind.I)]  # split: I and W
            if a.kind is Kind.F:  # its temporaries, then what the microbatch keeps
                peak = max(peak, live + c.keep + c.f_peak)
                live += c.keep
            elif a.kind is Kind.B:  # a recomputed forward's activations and the backward's own
                peak = max(peak, live + c.b_peak + beside)
                live -= c.keep
            elif a.kind is Kind.I:  # then what W reads (and starts from) stays until W
                peak = max(peak, live + c.i_peak + beside)
                live += c.held_to_w - c.keep
                peak = max(peak, live)
            elif a.kind is Kind.W:
                peak = max(peak, live + c.w_peak)
                live -= c.held_to_w
        params = sum(costs[s].params_at(tp) for s in mine)
        out.append(params * (2.0 + optimizer_state_factor) + peak + sum(received[-PREFETCH:]))
    return out


def _beside(acts, costs: list[StageCost]):
    """``(action, beside)`` of each single action: an OVERLAP's parts in turn, its backward
    with ``beside`` its forward's temporaries (the two interleave, so the backward peaks while
    they are alive); 0 elsewhere."""
    for top in acts:
        if top.parts is None:
            yield top, 0.0
        else:
            forward, backward = top.parts
            yield forward, 0.0
            yield backward, costs[forward.stage].f_peak


class _Phases(NamedTuple):
    """One microbatch of a stage as ``rank_memory`` walks it: what F leaves (``keep``), each
    phase's peak above what was live when it began (``F``'s above what it leaves), and what
    stays from I to W."""
    keep: float
    f_peak: float
    b_peak: float
    i_peak: float
    w_peak: float
    held_to_w: float

    @classmethod
    def of(cls, c: StageCost, split: bool) -> "_Phases":
        # measured recomputed (the received input, alive till FREE, besides what the phases allocated)
        if c.recompute and split and c.rs_held:  # recomputed at I
            return cls(c.in_bytes + c.rs_held, c.f_peak, c.recompute_bytes + c.b_peak, c.ri_peak, c.rw_peak,
                       c.in_bytes + c.ri_held)
        if c.recompute and not split and c.r_held:  # checkpointed
            return cls(c.in_bytes + c.r_held, c.f_peak, c.rb_peak, c.recompute_bytes + c.i_peak, c.w_peak,
                       _held_to_w(c))
        # measured without recompute, or the structural estimate (analytic costs: the dry run)
        return cls(c.act_bytes, c.f_peak, c.recompute_bytes + c.b_peak, c.recompute_bytes + c.i_peak, c.w_peak,
                   _held_to_w(c))


def _held_to_w(c: StageCost) -> float:
    """What a microbatch keeps from its I to its W: measured (Note [memory phases] in
    phases.py), else its activations, the gradients W starts from and a recomputed graph."""
    return c.i_held if c.i_held else c.act_bytes + c.seed_bytes + c.recompute_bytes
