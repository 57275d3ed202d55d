"""Execute a lowered schedule with blocking sends and receives, under one of two semantics.

``"rendezvous"`` (the check behind Note [deadlock-free ordering] in ``passes.py``): every
rank runs its program in order; a ``SEND_*`` completes only together with the peer's
matching ``RECV_*``.  ``"nccl"``: what the actors post (receives posted ahead, shape
headers, fed targets, collectives) runs in posted order on one queue per pair of ranks
(Note [NCCL order] in ``posting.py``, ``nccl_order.py``).  A program that cannot finish is
reported with every rank's stuck action.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from .actions import Action, Kind
from .errors import ScheduleError
from .context_order import RingExchanges
from .expert_order import ExpertCollectives
from .nccl_order import run_nccl_order
from .posting import PREFETCH
from .text import render_order
from .view import ScheduleView


__all__ = ["DeadlockError", "BlockingResult", "simulate_blocking", "peer_of"]


class DeadlockError(ScheduleError):
    """The lowered program would hang: each unfinished rank waits on another."""


@dataclasses.dataclass(frozen=True)
class BlockingResult:
    rounds: int  # parallel rounds until every rank finished
    transfers: int  # matched send/recv pairs


_MATCH = {Kind.SEND_F: (Kind.RECV_F, +1), Kind.SEND_B: (Kind.RECV_B, -1)}


def peer_of(schedule: ScheduleView, action: Action) -> int | None:
    """The rank on the other end of a send/recv action."""
    k, s = action.kind, action.stage
    step = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}.get(k)
    return None if step is None else schedule.stage_to_rank[s + step]


SEMANTICS = ("rendezvous", "nccl")


def simulate_blocking(schedule: ScheduleView, *, semantics: str = "rendezvous", prefetch: int = PREFETCH,
                      ordered: bool = True, dp: int = 1, relearn: bool = False, fed: bool = False,
                      train: Optional[bool] = None, communicators: str = "pair",
                      experts: Optional[ExpertCollectives] = None,
                      replicas: Optional[Sequence[ScheduleView]] = None,
                      ring: Optional[RingExchanges] = None) -> BlockingResult:
    """Run the lowered program with rendezvous point-to-point semantics, or (``semantics="nccl"``)
    one step of what the actors post under NCCL's order (Note [NCCL order] in ``posting.py``).

    The NCCL model takes: ``prefetch``, the receives posted ahead (``ordered``: only once the
    earlier sends to that peer are posted, as the actors do on NCCL; ``False``: as on gloo);
    ``dp`` replicas (each rank's ``ALLREDUCE`` a collective of its replicas); ``relearn``: the
    step that learns shapes (a header before each activation, nothing posted ahead); ``fed``:
    the targets sent first from the first stage's rank to the last's (Note [fed steps]);
    ``train``: the agreed update's all-reduce at the end (default: unless forward-only);
    ``communicators``: ``"pair"``, a stream per pair of ranks (the actors' point-to-point
    groups), or ``"world"``, every rank's messages on one stream (torch's eager init on a
    world of more than two: Note [point-to-point groups] in actors/comm.py); ``experts``: the
    all-to-alls of MoE stages on their EP groups, the EDP and loads sums (Note [expert all-to-alls
    in the order model] in expert_order.py); ``replicas``: each replica's own program where they
    differ (default: every replica runs ``schedule``); ``ring``: the ring steps of attention stages on
    their CP groups, ``dp`` then counting a rank's ``dp x cp`` actors (Note [ring exchanges in the
    order model] in context_order.py).  The rendezvous model ignores them.

    Raises ``DeadlockError`` listing each rank's stuck action, or ``ScheduleError``
    when a matched send and receive disagree (the k-th message on a channel is not
    the one the receiver expects) or a compute uses data that was never received.
    """
    if semantics not in SEMANTICS:
        raise ValueError(f"semantics={semantics!r}: expected one of {', '.join(map(repr, SEMANTICS))}")
    if prefetch < 0 or dp < 1:
        raise ValueError(f"prefetch ({prefetch}) must be >= 0 and dp ({dp}) >= 1")
    if semantics == "nccl":
        rounds, transfers = run_nccl_order(schedule, prefetch=prefetch, ordered=ordered, dp=dp, relearn=relearn,
                                           fed=fed, train=train, deadlock_error=DeadlockError,
                                           check_inputs=_check_inputs, communicators=communicators,
                                           experts=experts, replicas=replicas, ring=ring)
        return BlockingResult(rounds=rounds, transfers=transfers)
    progs = schedule.ranks
    pc = [0] * len(progs)
    have: list[set] = [set() for _ in progs]  # (kind, stage, mb) data present on each rank
    rounds = transfers = 0
    ties: dict[int, dict[int, Action]] = {}  # tie group -> {rank: its TIE_REDUCE} (a collective)
    for r, prog in enumerate(progs):
        for a in prog:
            if a.kind is Kind.TIE_REDUCE:
                ties.setdefault(a.tie_group, {})[r] = a
    while any(pc[r] < len(p) for r, p in enumerate(progs)):
        rounds += 1
        progressed = False
        for r, prog in enumerate(progs):
            while pc[r] < len(prog):
                a = prog[pc[r]]
                if a.kind in _MATCH:
                    recv_kind, step = _MATCH[a.kind]
                    dst = schedule.stage_to_rank[a.stage + step]
                    if pc[dst] >= len(progs[dst]):
                        break
                    b = progs[dst][pc[dst]]
                    if b.kind not in (Kind.RECV_F, Kind.RECV_B) or peer_of(schedule, b) != r:
                        break  # the peer is busy elsewhere: wait
                    want = Action(a.stage + step, recv_kind, a.microbatch)
                    if b != want:
                        raise ScheduleError(
                            f"rank {r} sends {a!r} while rank {dst} expects {b!r} on the same channel: "
                            f"messages would pair wrongly\n" + render_order(schedule, mark=(dst, pc[dst]))
                        )
                    have[dst].add((recv_kind, b.stage, b.microbatch))
                    pc[dst] += 1
                    transfers += 1
                elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                    break  # completes only when the sender arrives
                elif a.kind is Kind.TIE_REDUCE:
                    members = ties[a.tie_group]
                    if any(pc[m] >= len(progs[m]) or progs[m][pc[m]] != b for m, b in members.items()):
                        break  # completes only when every rank of the group is there
                    for m in members:
                        if m != r:
                            pc[m] += 1
                else:
                    _check_inputs(schedule, r, pc[r], have[r])
                    have[r].update((b.kind, b.stage, b.microbatch) for b in a.flat)
                pc[r] += 1
                progressed = True
        if not progressed:
            raise DeadlockError(_deadlock_message(schedule, pc))
    return BlockingResult(rounds=rounds, transfers=transfers)


def _check_inputs(schedule: ScheduleView, r: int, pos: int, have: set) -> None:
    for a in schedule.ranks[r][pos].flat:  # an OVERLAP's parts both need their inputs before it
        _check_part(schedule, r, pos, a, have)


def _check_part(schedule: ScheduleView, r: int, pos: int, a: Action, have: set) -> None:
    s, k, m = a.stage, a.kind, a.microbatch
    owner = schedule.stage_to_rank
    need = None
    if k is Kind.F and s > 0:
        need = (Kind.RECV_F, s, m) if owner[s - 1] != r else (Kind.F, s - 1, m)
    elif k in (Kind.B, Kind.I) and s + 1 < schedule.num_stages:
        nk = schedule.backward_of(s + 1, m)
        need = (Kind.RECV_B, s, m) if owner[s + 1] != r else (nk, s + 1, m)
    elif k is Kind.W:
        need = (Kind.I, s, m)
    if need is not None and need not in have:
        raise ScheduleError(
            f"rank {r}, position {pos}: {a!r} runs before its input {Action(need[1], need[0], m)!r} is there\n"
            + render_order(schedule, mark=(r, pos))
        )


def _deadlock_message(schedule: ScheduleView, pc: list[int]) -> str:
    lines = ["deadlock: the lowered program cannot finish with blocking sends and receives"]
    mark = None
    for r, prog in enumerate(schedule.ranks):
        if pc[r] < len(prog):
            a = prog[pc[r]]
            peer = f"rank {peer_of(schedule, a)}" if a.kind is not Kind.TIE_REDUCE else "its tie group"
            lines.append(f"  rank {r}, position {pc[r]}: stuck at {a!r} (waiting for {peer})")
            mark = mark or (r, pc[r])
        else:
            lines.append(f"  rank {r}: finished")
    lines.append(render_order(schedule, mark=mark))
    return "\n".join(lines)
