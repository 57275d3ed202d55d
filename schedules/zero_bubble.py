"""Zero-bubble schedules: backward split into ``I`` (input gradient) and ``W`` (weight gradient).

Only ``I`` is on the critical path: the previous stage waits for the input gradient,
nobody waits for ``W``.  So a rank can run its ``W``'s late, in the gaps where 1F1B
would sit idle.  Four generators are registered here:

``zb-h1``      Qi et al. 2023 ("Zero Bubble Pipeline Parallelism"), handcrafted ZB-H1.
               1F1B's memory, bubble ``(p-1)(f+b-w)`` (for ``w <= f``).
``zb-h2``      the same paper's ZB-H2: twice the in-flight microbatches, no bubble
               when ``f = b = w`` and ``m >= 2p-1``.
``zbv``        ZB-V (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory"):
               two stages per rank in a V, 1F1B's activation memory, no bubble when
               ``f = b = w`` and ``m >= 2p-1``.
``dualpipev``  DeepSeek's DualPipeV (the cut-in-half DualPipe of DeepSeek-V3): V stage
               map, forward of one chunk paired with backward of the other.

Every backward here is an ``I`` plus a ``W``, as the papers write them; a ``W`` placed
right after its ``I`` stands for a fused backward.  A Pipeline runs such a pair as one
``B`` where the timeline does not use the split (``fuse.fuse_backwards``, Note [fused
where free]), so one stage may fuse some microbatches and split others.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Optional

from .actions import Action, Kind
from .generators import ScheduleInfo, register_schedule
from .placement import looped_stage_to_rank, v_stage_to_rank
from .schedule import Schedule

__all__: list[str] = []  # everything is reached through get_schedule


class _RankProgram:
    """One rank's action list, with per-stage microbatch counters and deferred ``W``'s.

    ``chunk`` indexes ``stages``: chunk 0 is the rank's first stage, chunk 1 its second.
    """

    def __init__(self, stages: tuple[int, ...]) -> None:
        self.stages = stages
        self.actions: list[Action] = []
        self._next_f = [0] * len(stages)
        self._next_i = [0] * len(stages)
        self._deferred: deque[Action] = deque()  # W's in the order their I's ran

    def forward(self, chunk: int = 0) -> None:
        self.actions.append(Action(self.stages[chunk], Kind.F, self._next_f[chunk]))
        self._next_f[chunk] += 1

    def backward(self, chunk: int = 0, *, defer_w: bool = False) -> None:
        """``I`` of the oldest microbatch awaiting backward; its ``W`` now or deferred."""
        mb = self._next_i[chunk]
        self._next_i[chunk] += 1
        self.actions.append(Action(self.stages[chunk], Kind.I, mb))
        w = Action(self.stages[chunk], Kind.W, mb)
        if defer_w:
            self._deferred.append(w)
        else:
            self.actions.append(w)

    def weight(self, chunk: Optional[int] = None) -> None:
        """Run the oldest deferred ``W`` (of ``chunk``'s stage, when given)."""
        if chunk is None:
            w = self._deferred.popleft()
        else:
            w = next(a for a in self._deferred if a.stage == self.stages[chunk])
            self._deferred.remove(w)
        self.actions.append(w)

    def flush(self, chunk: Optional[int] = None) -> None:
        """Run every deferred ``W`` (of ``chunk``'s stage, when given), oldest first."""
        keep = self.stages[chunk] if chunk is not None else None
        for w in [a for a in self._deferred if keep is None or a.stage == keep]:
            self._deferred.remove(w)
            self.actions.append(w)

    def overlapped(self, forward: int, backward: int) -> None:
        """``F`` of chunk ``forward`` and ``I`` of chunk ``backward`` as one OVERLAP, the
        ``W`` right after it (``fuse_backwards`` makes it a ``B`` inside the OVERLAP where free)."""
        self.forward(forward)
        self.backward(backward)
        f, i, w = self.actions[-3:]
        self.actions[-3:] = [Action.overlap(f, i), w]

    @property
    def deferred(self) -> int:
        return len(self._deferred)

    def finish(self, num_microbatches: int) -> list[Action]:
        assert not self._deferred, f"W's left deferred: {list(self._deferred)}"
        assert self._next_f == self._next_i, (self._next_f, self._next_i)
        # Generators that build for more microbatches than asked drop the extra ones:
        # the order restricted to the kept actions is still one that can finish.
        return [a for a in self.actions if all(p.microbatch < num_microbatches for p in a.flat)]


def _check_stages_per_rank(name: str, v: int, want: int) -> None:
    if v != want:
        raise ValueError(f"{name} needs stages_per_rank = {want}, got {v}")


# -- ZB-H1 and ZB-H2: one stage per rank --------------------------------------------------------


def _one_f_one_i(p: int, m: int, name: str, warmup: list[int], held: list[int]) -> Schedule:
    """1F1B with ``I`` in place of ``B``; rank ``r`` holds up to ``held[r]`` ``W``'s back.

    Rank ``r`` runs ``warmup[r]`` forwards, then pairs ``F, I`` while forwards remain, then
    the remaining ``I``'s.  After each ``I`` it runs the oldest pending ``W`` once more than
    ``held[r]`` are pending, and runs what is still pending at the end.
    """
    ranks = []
    for r in range(p):
        prog = _RankProgram((r,))
        n_warm = min(warmup[r], m)
        for _ in range(n_warm):
            prog.forward()
        for k in range(m):
            if n_warm + k < m:
                prog.forward()
            prog.backward(defer_w=True)
            if prog.deferred > held[r]:
                prog.weight()
        prog.flush()
        ranks.append(prog.finish(m))
    return Schedule(ranks, m, looped_stage_to_rank(p, 1), name=name)


def _zb_h1(p: int, m: int, v: int) -> Schedule:
    """ZB-H1: 1F1B's warmup (``p-1-r`` forwards on rank ``r``), ``B`` split into ``I`` and
    ``W``, and rank ``r`` holding ``r`` ``W``'s back.

    The last rank runs its ``I``'s ``p-1`` W-slots earlier than in 1F1B, so the final
    input gradients reach rank 0 sooner; each rank spends the cooldown gaps (where 1F1B
    waits for gradients) on its held ``W``'s.  With ``w <= f`` the bubble is
    ``(p-1)(f+b-w)`` against 1F1B's ``(p-1)(f+b+w)``; in-flight activations (``F`` to
    ``I``) are 1F1B's, ``min(p-r, m)`` on rank ``r``.
    """
    _check_stages_per_rank("zb-h1", v, 1)
    return _one_f_one_i(p, m, "zb-h1", [p - 1 - r for r in range(p)], list(range(p)))


def _zb_h2(p: int, m: int, v: int) -> Schedule:
    """ZB-H2: rank ``r`` runs ``2(p-1-r)`` warmup forwards (``2(p-r)-1`` in flight) and
    holds ``2r`` ``W``'s back.

    The extra forwards fill the time until the first input gradient arrives
    (``(p-r)f + (p-1-r)b`` after rank ``r`` starts); the held ``W``'s fill the
    cooldown.  With ``f = b = w`` and ``m >= 2p-1`` no rank is ever idle between its
    first and last action.
    """
    _check_stages_per_rank("zb-h2", v, 1)
    if m < 2 * p - 1:
        need = 2 * p - 1
        raise ValueError(
            f"zb-h2 needs num_microbatches >= 2*num_ranks - 1 = {need} for {p} ranks, got {m}: "
            f"its warmup keeps up to {need} microbatches in flight on rank 0; "
            f"use {need} or more, or zb-h1 for fewer microbatches"
        )
    return _one_f_one_i(p, m, "zb-h2", [2 * (p - 1 - r) for r in range(p)], [2 * r for r in range(p)])


# -- V-shaped: stage r and 2p-1-r on rank r -----------------------------------------------------


def _zbv(p: int, m: int, v: int) -> Schedule:
    """ZB-V.  Rank ``r`` owns chunk 0 = stage ``r`` and chunk 1 = stage ``2p-1-r``.

    Built for ``n = max(m, 2p-1)`` microbatches (then the extra ones are dropped):

    1. ``2(p-r)-1`` forwards of chunk 0 (the way down to the turn at rank ``p-1``);
    2. ``r`` times ``F1, F0`` (chunk 1's first inputs are coming back up);
    3. ``p-r`` times ``F1, I1, W1`` (chunk 1's gradients start on rank 0, the last stage);
    4. steady state, ``n-p`` times ``[F0,] I0, W0, F1, I1, W1`` (``F0`` while chunk 0 has
       forwards left);
    5. cooldown: ``r`` times ``I0, I1`` with both ``W``'s held back, then ``p-r`` times
       ``I0`` plus the oldest held chunk-0 ``W``, then the held chunk-1 ``W``'s, then the
       rest of chunk 0's.

    Peak live activations per rank are ``2p`` half-size chunks, 1F1B's ``p`` full
    stages on rank 0; with ``f = b = w`` and ``m >= 2p-1`` the bubble is zero.
    """
    _check_stages_per_rank("zbv", v, 2)
    n = max(m, 2 * p - 1)
    ranks = []
    for r in range(p):
        prog = _RankProgram((r, 2 * p - 1 - r))
        for _ in range(2 * (p - r) - 1):
            prog.forward(0)
        for _ in range(r):
            prog.forward(1)
            prog.forward(0)
        for _ in range(p - r):
            prog.forward(1)
            prog.backward(1)
        forwards0_left = n - (2 * p - r - 1)
        for k in range(n - p):
            if k < forwards0_left:
                prog.forward(0)
            prog.backward(0)
            prog.forward(1)
            prog.backward(1)
        for _ in range(r):
            prog.backward(0, defer_w=True)
            prog.backward(1, defer_w=True)
        for _ in range(p - r):
            prog.backward(0, defer_w=True)
            prog.weight(0)
        prog.flush(1)
        prog.flush(0)
        ranks.append(prog.finish(m))
    return Schedule(ranks, m, v_stage_to_rank(p), name="zbv")


def _dualpipev(p: int, m: int, v: int, overlap: bool = False) -> Schedule:
    """DualPipeV (DeepSeek's DualPipe repo, ``dualpipev.py``; torch's ``ScheduleDualPipeV``).

    Rank ``r`` owns chunk 0 = stage ``r`` and chunk 1 = stage ``2p-1-r``.  DualPipe
    runs the forward of one chunk overlapped with the backward of the other; here the
    pair is written forward first, then backward.  ``B(c)`` below is ``I`` then ``W``
    of chunk ``c``; ``I*(c)`` holds the ``W`` back in one FIFO and ``W*`` runs the
    oldest held one.  The phases of rank ``r``:

    1. ``2(p-1-r)`` forwards of chunk 0;
    2. ``r+1`` times ``F0, F1``;
    3. ``p-1-r`` times ``I*(1), W*, F1`` (zero-bubble backward of chunk 1);
    4. main phase, ``m-2p+r+1`` times ``F0 + B(1)``, ``F1 + B(0)`` (the overlapped pairs);
    5. ``p-1-r`` times ``B(1)``, ``F1 + B(0)``;
    6. ``r+1`` times ``B(1), B(0)``, switching to ``I*`` half-way (at step
       ``(r+1)//2``, before ``B(1)`` on odd ranks and after it on even ranks);
    7. ``p-1-r`` times ``W*, I*(0)``;
    8. ``W*`` for what is still held (``r+1`` of them).

    Phase 4 must run at least once on rank 0, hence ``m >= 2p``.  With ``overlap`` the pairs
    of phases 4 and 5 (``F + B``) are OVERLAP actions (Note [overlapped forward and backward]
    in actions.py): ``F0+I1 W1``, ``F1+I0 W0``, fused to ``F0+B1`` where free.
    """
    _check_stages_per_rank("dualpipev", v, 2)
    if m < 2 * p:
        raise ValueError(
            f"dualpipev needs num_microbatches >= 2*num_ranks = {2 * p} for {p} ranks, got {m}: "
            f"its warmup fills both chunks of every rank before the main phase; "
            f"use {2 * p} or more, or zbv, which takes any number"
        )
    ranks = []
    for r in range(p):
        prog = _RankProgram((r, 2 * p - 1 - r))
        for _ in range(2 * (p - 1 - r)):
            prog.forward(0)
        for _ in range(r + 1):
            prog.forward(0)
            prog.forward(1)
        for _ in range(p - 1 - r):
            prog.backward(1, defer_w=True)
            prog.weight()
            prog.forward(1)
        pair = prog.overlapped if overlap else _in_turn(prog)
        for _ in range(m - 2 * p + r + 1):
            pair(0, 1)
            pair(1, 0)
        for _ in range(p - 1 - r):
            prog.backward(1)
            pair(1, 0)
        defer = False
        for k in range(r + 1):
            if k == (r + 1) // 2 and r % 2 == 1:
                defer = True
            prog.backward(1, defer_w=defer)
            if k == (r + 1) // 2 and r % 2 == 0:
                defer = True
            prog.backward(0, defer_w=defer)
        for _ in range(p - 1 - r):
            prog.weight()
            prog.backward(0, defer_w=True)
        prog.flush()
        ranks.append(prog.finish(m))
    return Schedule(ranks, m, v_stage_to_rank(p), name="dualpipev")


def _in_turn(prog: _RankProgram):
    """A pair written forward first, then backward (I and W), not overlapped."""
    def pair(forward: int, backward: int) -> None:
        prog.forward(forward)
        prog.backward(backward)
    return pair


register_schedule(
    ScheduleInfo(name="zb-h1", build=_zb_h1, description="zero bubble H1: 1F1B memory, bubble (p-1)(f+b-w)")
)
register_schedule(
    ScheduleInfo(name="zb-h2", build=_zb_h2, description="zero bubble H2: 2p-1 in flight, no bubble for m >= 2p-1")
)
register_schedule(
    ScheduleInfo(
        name="zbv",
        build=_zbv,
        default_stages_per_rank=2,
        allowed_stages_per_rank=(2,),
        description="zero bubble V: stages r and 2p-1-r on rank r, 1F1B memory",
    )
)
register_schedule(
    ScheduleInfo(
        name="dualpipev",
        build=_dualpipev,
        overlapped=functools.partial(_dualpipev, overlap=True),
        default_stages_per_rank=2,
        allowed_stages_per_rank=(2,),
        description="DeepSeek DualPipeV: V stage map, paired forward/backward of the two chunks, m >= 2p",
    )
)
