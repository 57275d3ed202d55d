"""Run what the actors post under NCCL's order (Note [NCCL order] in ``posting.py``).

Every rank posts its step (``posting.posts_of_rank``); sends and receives go onto one
first-in-first-out queue per pair of ranks, both directions together; the head of a
pair's queue on one rank completes only with the matching head on the other; a
collective completes once every member has it at the head of its group's queue.  A
rank goes on after posting, and stops only at a wait (a receive's data, its sends at
the end, a collective's result).  With ``dp`` replicas every replica runs the program.
"""

from __future__ import annotations

import collections
from typing import Optional

from .actions import Action, Kind
from .errors import ScheduleError
from .posting import Post, posts_of_rank
from .text import render_order
from .view import ScheduleView

__all__ = ["run_nccl_order", "step_peers"]


def step_peers(schedule: ScheduleView, program) -> list[int]:
    """The pipeline rank at the other end of each send/receive of ``program`` (-1 elsewhere)."""
    step = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}
    return [schedule.stage_to_rank[a.stage + step[a.kind]] if a.kind in step else -1 for a in program]


def run_nccl_order(schedule: ScheduleView, *, prefetch: int, ordered: bool, dp: int, relearn: bool,
                   fed: bool, train: Optional[bool], deadlock_error, check_inputs) -> tuple[int, int]:
    """(rounds, transfers) of one step; raises ``deadlock_error`` naming each stuck rank."""
    p = len(schedule.ranks)
    train = (not schedule.forward_only) if train is None else train
    feeder = (schedule.stage_to_rank[0], schedule.stage_to_rank[schedule.num_stages - 1]) if fed else None
    posts, peers = [], [step_peers(schedule, prog) for prog in schedule.ranks]
    for d in range(dp):
        for r, prog in enumerate(schedule.ranks):
            posts.append(posts_of_rank(prog, peers[r], replica=d, num_ranks=p, rank=r, window=prefetch,
                                       ordered=ordered, relearn=relearn, fed=feeder, train=train))
    world = len(posts)
    members: dict[tuple, set] = collections.defaultdict(set)
    for g, ps in enumerate(posts):
        for x in ps:
            if x.op == "coll":
                members[x.group].add(g)
    pc = [0] * world
    queues: dict[tuple, list[collections.deque]] = {}  # (low, high) or group -> per-rank queue
    done: list[set] = [set() for _ in range(world)]  # receive idents complete
    unsent = [0] * world  # sends posted and not yet matched
    have: list[set] = [set() for _ in range(world)]
    where = [{a: i for i, a in enumerate(prog)} for prog in schedule.ranks]
    rounds = transfers = 0
    while True:
        rounds += 1
        progressed = False
        for g in range(world):
            while pc[g] < len(posts[g]):
                x = posts[g][pc[g]]
                if x.op in ("send", "recv"):
                    pair = (min(g, x.peer), max(g, x.peer))
                    q = queues.setdefault(pair, [collections.deque(), collections.deque()])
                    q[g != pair[0]].append(x)
                    unsent[g] += x.op == "send"
                elif x.op == "coll":
                    if ("coll", x.group) in done[g]:
                        done[g].discard(("coll", x.group))
                    else:
                        key = ("group",) + x.group
                        q = queues.setdefault(key, {m: collections.deque() for m in members[x.group]})
                        if not q[g] or q[g][-1] is not x:
                            q[g].append(x)
                        break
                elif x.op == "wait":
                    if x.ident not in done[g]:
                        break
                    if x.action is not None and x.action.kind in (Kind.RECV_F, Kind.RECV_B):
                        have[g].add((x.action.kind, x.action.stage, x.action.microbatch))
                elif x.op == "flush":
                    if unsent[g]:
                        break
                else:
                    check_inputs(schedule, g % p, where[g % p][x.action], have[g])
                    have[g].add((x.action.kind, x.action.stage, x.action.microbatch))
                pc[g] += 1
                progressed = True
        for key, q in queues.items():
            if key[0] == "group":
                heads = [_label(d[0]) if d else None for d in q.values()]
                if heads[0] is not None and all(h == heads[0] for h in heads):
                    for m, d in q.items():
                        d.popleft()
                        done[m].add(("coll", key[1:]))
                    progressed = True
                continue
            while q[0] and q[1]:
                a, b = q[0][0], q[1][0]
                if a.op == b.op:
                    break  # both send or both receive: each waits for the other's stream
                send, recv = (a, b) if a.op == "send" else (b, a)
                if send.message != recv.message:
                    raise ScheduleError(
                        f"rank {recv.peer} sends {send.message} while rank {send.peer} expects {recv.message} "
                        f"on the same NCCL stream: messages would pair wrongly")
                q[0].popleft()
                q[1].popleft()
                done[send.peer].add(recv.ident)
                unsent[recv.peer] -= 1
                transfers += 1
                progressed = True
        if all(pc[g] == len(posts[g]) for g in range(world)):
            return rounds, transfers
        if not progressed:
            raise deadlock_error(_message(schedule, posts, pc, queues, p, relearn, prefetch, ordered))


def _position(schedule: ScheduleView, r: int, a: Action) -> int:
    return list(schedule.ranks[r]).index(a)


def _label(x: Post):
    """What a collective is, alike on every member (a tie reduction names the rank's own stage)."""
    a = x.action
    return "update" if a is None else (a.microbatch if a.kind is Kind.TIE_REDUCE else a)


def _message(schedule: ScheduleView, posts, pc, queues, p: int, relearn: bool, prefetch: int, ordered: bool) -> str:
    order = f"prefetch {prefetch}, {'ordered' if ordered else 'unordered'}"
    which = ("in the first step, which learns shapes (a header before each activation, no prefetch)" if relearn
             else f"from step 2 on ({order})")
    lines = [f"deadlock under NCCL's order {which}: each pair of ranks runs its operations in posted order on one "
             f"stream, and no rank can go on"]
    mark = None
    for g, ps in enumerate(posts):
        replica, r = divmod(g, p)
        who = f"rank {r}" + (f" (replica {replica})" if len(posts) > p else "")
        if pc[g] >= len(ps):
            lines.append(f"  {who}: finished")
            continue
        x = ps[pc[g]]
        what = _describe(x)
        heads = [f"{_describe(q[g != key[0]][0])} to/from rank {key[1] if g == key[0] else key[0]}"
                 for key, q in queues.items() if key[0] != "group" and g in key and q[g != key[0]]]
        blocked = f"; its streams start with {', '.join(heads)}" if heads else ""
        lines.append(f"  {who}: stuck at {what}{blocked}")
        if mark is None and x.action is not None and x.action in schedule.ranks[r]:
            mark = (r, _position(schedule, r, x.action))
    lines.append(render_order(schedule, mark=mark))
    return "\n".join(lines)


def _describe(x: Post) -> str:
    if x.op == "coll":
        return f"{x.action!r}" if x.action is not None else "the agreed update's all-reduce"
    if x.op == "flush":
        return "the end of the step (its sends not yet matched)"
    what = repr(x.action) if x.action is not None else "the fed targets"
    if x.message and x.message[-1] == "header":
        what += "'s shape header"
    return {"send": f"{what} (send)", "recv": f"{what} (posted receive)", "wait": f"{what} (waiting for data)"}.get(
        x.op, what)
