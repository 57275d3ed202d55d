"""Run what the actors post under NCCL's order (Note [NCCL order] in ``posting.py``).

Every rank posts its step (``posting.posts_of_rank``); sends and receives go onto one
first-in-first-out queue per pair of ranks, both directions together (or, modelling
point-to-point on an eagerly initialised world group, onto each rank's one queue for
every peer); the head of a queue on one rank completes only with the matching head on
the other; a collective completes once every member has it at the head of its group's queue.  A
rank goes on after posting, and stops only at a wait (a receive's data, its sends at
the end, a collective's result).  With ``dp`` replicas every replica runs the program (or
each its own: ``replicas``), and with ``experts`` the compute of MoE stages issues all-to-alls
on the EP groups (Note [expert all-to-alls in the order model] in expert_order.py); with ``ring``
the compute of attention stages issues ring steps on the CP groups, the ``dp`` replicas then
being a rank's ``dp x cp`` actors (Note [ring exchanges in the order model] in context_order.py).
"""

from __future__ import annotations

import collections
from typing import Optional, Sequence

from .actions import Action, Kind
from .errors import ScheduleError
from .context_order import RingExchanges
from .expert_order import ExpertCollectives
from .posting import Post, posts_of_rank
from .text import render_order
from .view import ScheduleView

__all__ = ["run_nccl_order", "step_peers", "linked_ranks", "COMMUNICATORS"]


def step_peers(schedule: ScheduleView, program) -> list[int]:
    """The pipeline rank at the other end of each send/receive of ``program`` (-1 elsewhere)."""
    step = {Kind.SEND_F: +1, Kind.RECV_F: -1, Kind.SEND_B: -1, Kind.RECV_B: +1}
    return [schedule.stage_to_rank[a.stage + step[a.kind]] if a.kind in step else -1 for a in program]


COMMUNICATORS = ("pair", "world")


def linked_ranks(schedule: ScheduleView) -> list[tuple[int, int]]:
    """The pairs ``(low, high)`` of pipeline ranks that may exchange messages: the ranks of
    consecutive stages, and the first and the last stage's (fed steps' targets, Note [fed
    steps]); each gets a process group of its own (Note [point-to-point groups] in actors/comm.py)."""
    owner = schedule.stage_to_rank
    ends = [(owner[s], owner[s + 1]) for s in range(schedule.num_stages - 1)] + [(owner[0], owner[-1])]
    return sorted({(min(a, b), max(a, b)) for a, b in ends if a != b})


def run_nccl_order(schedule: ScheduleView, *, prefetch: int, ordered: bool, dp: int, relearn: bool,
                   fed: bool, train: Optional[bool], deadlock_error, check_inputs,
                   communicators: str = "pair", experts: Optional[ExpertCollectives] = None,
                   replicas: Optional[Sequence[ScheduleView]] = None,
                   ring: Optional[RingExchanges] = None) -> tuple[int, int]:
    """(rounds, transfers) of one step; raises ``deadlock_error`` naming each stuck rank.

    ``communicators``: ``"pair"``, each pair's messages on a group (one stream) of its own, as
    the actors run them; ``"world"``, every message and the world's collective on each rank's
    one stream of the world group, as torch runs unbatched point-to-point operations on an
    eagerly initialised group (Note [point-to-point groups] in actors/comm.py).
    ``experts``: the EP collectives; ``replicas``: each replica's own lowered program (the
    same stages on the same ranks), where they differ; ``ring``: the CP groups' ring steps (``dp``
    counts the ``dp x cp`` members of each rank's gradient average)."""
    if communicators not in COMMUNICATORS:
        raise ValueError(f"communicators={communicators!r}: expected one of {', '.join(map(repr, COMMUNICATORS))}")
    if replicas is not None and len(replicas) != dp:
        raise ValueError(f"replicas: expected one program per replica (dp={dp}), got {len(replicas)}")
    cp = ring.cp if ring is not None else 1
    if dp % cp:
        raise ValueError(f"ring.cp={cp} must divide dp={dp}: the members of a rank's gradient average are its "
                         f"dp x cp actors (Note [ring exchanges in the order model] in context_order.py)")
    if experts is not None and dp % experts.ep:
        raise ValueError(f"experts.ep={experts.ep} must divide dp={dp}: an EP group is ep of a rank's dp (x cp) members "
                         f"(Note [expert parallelism] in actors/grid.py)")
    p = len(schedule.ranks)
    train = (not schedule.forward_only) if train is None else train
    feeder = (schedule.stage_to_rank[0], schedule.stage_to_rank[schedule.num_stages - 1]) if fed else None
    programs = list(replicas) if replicas is not None else [schedule] * dp
    posts = []
    for d, program in enumerate(programs):
        for r, prog in enumerate(program.ranks):
            posts.append(posts_of_rank(prog, step_peers(program, prog), replica=d, num_ranks=p, rank=r,
                                       window=prefetch, ordered=ordered, relearn=relearn, fed=feeder, train=train,
                                       experts=experts, dp=dp, ring=ring))
    world = len(posts)
    members: dict[tuple, set] = collections.defaultdict(set)
    for g, ps in enumerate(posts):
        for x in ps:
            if x.op == "coll":
                members[_stream(x, g, communicators)] |= _members(x, g, p, dp, experts, cp)
    if communicators == "world":
        members[("world",)] = set(range(world))
    pc = [0] * world
    queues: dict[tuple, dict[int, collections.deque]] = {}  # stream -> member -> its queue there
    done: list[set] = [set() for _ in range(world)]  # receive idents complete
    unsent = [0] * world  # sends posted and not yet matched
    have: list[set] = [set() for _ in range(world)]
    where = [{a: i for i, a in enumerate(prog)} for program in programs for prog in program.ranks]
    rounds = transfers = 0
    while True:
        rounds += 1
        progressed = False
        for g in range(world):
            while pc[g] < len(posts[g]):
                x = posts[g][pc[g]]
                if x.op in ("send", "recv"):
                    queues.setdefault(_stream(x, g, communicators), {}).setdefault(g, collections.deque()).append(x)
                    unsent[g] += x.op == "send"
                elif x.op == "coll":
                    key = _stream(x, g, communicators)
                    if ("coll", key) in done[g]:
                        done[g].discard(("coll", key))
                    else:
                        q = queues.setdefault(key, {}).setdefault(g, collections.deque())
                        if not q or q[-1] is not x:
                            q.append(x)
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
                    check_inputs(programs[g // p], g % p, where[g][x.action], have[g])
                    have[g].update((a.kind, a.stage, a.microbatch) for a in x.action.flat)  # an OVERLAP: both parts
                pc[g] += 1
                progressed = True
        for key, q in queues.items():
            matched = _match(key, q, members.get(key, ()), done, unsent, p, deadlock_error)
            transfers += matched[0]
            progressed = progressed or matched[1]
        if all(pc[g] == len(posts[g]) for g in range(world)):
            return rounds, transfers
        if not progressed:
            raise deadlock_error(_message(schedule, posts, pc, queues, p, relearn, prefetch, ordered, communicators))


def _stream(x: Post, g: int, communicators: str) -> tuple:
    """The stream (process group) global rank ``g`` runs post ``x`` on."""
    if x.op == "coll":
        return ("world",) if communicators == "world" and x.group == ("world",) else ("group",) + x.group
    return ("world",) if communicators == "world" else ("pair", min(g, x.peer), max(g, x.peer))


def _members(x: Post, g: int, p: int, dp: int, experts: Optional[ExpertCollectives], cp: int = 1) -> set:
    """The global ranks of the group collective ``x`` of global rank ``g`` runs on: the grid's
    (every replica of a pipeline rank; its EP, EDP or CP group), whatever the others post; a tie
    group's, those that post on it.  ``g``'s replica numbers the rank's ``dp`` members, ``replica
    x cp + CP rank`` (Note [ring exchanges in the order model])."""
    member, rank = divmod(g, p)
    replica = member // cp
    kind = x.group[0] if x.group else None
    if kind == "dp":
        return {d * p + rank for d in range(dp)}
    if kind == "ep":  # ``ep`` consecutive members (Note [expert parallelism] in actors/grid.py)
        return {m * p + rank for m in experts.ep_group(member)}
    if kind == "edp":
        return {m * p + rank for m in experts.edp_group(member, dp)}
    if kind == "cp":
        return {(replica * cp + c) * p + rank for c in range(cp)}
    return {g}


def _match(key: tuple, q: dict, members, done: list, unsent: list, p: int, deadlock_error) -> tuple[int, bool]:
    """Complete what the heads of stream ``key``'s queues allow: a collective once every
    member has it at the head, a send and a receive at the heads of their two ends.
    (transfers, whether anything completed).  Members of one group at different collectives
    can never go on: ``deadlock_error`` naming them."""
    transfers, progressed, again = 0, False, True
    while again:
        again = False
        heads = {m: d[0] for m, d in q.items() if d}
        colls = [x for x in heads.values() if x.op == "coll"]
        if colls and members and all(m in heads and heads[m].op == "coll" for m in members) and \
                len({_label(heads[m]) for m in members}) > 1:
            raise deadlock_error(_order_message(key, heads, sorted(members), p))
        if colls and members and all(m in heads and heads[m].op == "coll" and _label(heads[m]) == _label(colls[0])
                                     for m in members):
            for m in members:
                q[m].popleft()
                done[m].add(("coll", key))
            progressed = again = True
            continue
        for m, x in heads.items():
            if x.op not in ("send", "recv") or x.peer not in heads:
                continue
            y = heads[x.peer]
            if y.op not in ("send", "recv") or y.peer != m or y.op == x.op:
                continue  # the peer's stream is busy elsewhere, or both send (or receive): each waits
            send, recv = (x, y) if x.op == "send" else (y, x)
            if send.message != recv.message:
                raise ScheduleError(
                    f"rank {recv.peer} sends {send.message} while rank {send.peer} expects {recv.message} "
                    f"on the same NCCL stream: messages would pair wrongly")
            q[m].popleft()
            q[x.peer].popleft()
            done[send.peer].add(recv.ident)
            unsent[recv.peer] -= 1
            transfers += 1
            progressed = again = True
            break
    return transfers, progressed


def _position(schedule: ScheduleView, r: int, a: Action) -> int:
    return list(schedule.ranks[r]).index(a)


def _label(x: Post):
    """What a collective is, alike on every member (a tie reduction names the rank's own stage;
    an expert exchange its action and which of its exchanges)."""
    a = x.action
    return ("update" if a is None else (a.tie_group if a.kind is Kind.TIE_REDUCE else a), x.message)


def _order_message(key: tuple, heads: dict, members: list, p: int) -> str:
    kind = key[1] if len(key) > 1 else "world"
    what = {"ep": "EP group", "edp": "EDP group", "dp": "dp group", "tie": "tie group", "cp": "CP group"}.get(
        kind, "world group")
    cp = len(members) if kind == "cp" else 1  # a CP group's members: one replica's CP ranks
    who = (lambda m: f"replica {m // p // cp}, CP rank {m // p % cp}") if cp > 1 else (lambda m: f"replica {m // p}")
    whom = (f"replica {members[0] // p // cp}, CP ranks 0..{cp - 1}" if cp > 1
            else f"replicas {', '.join(str(m // p) for m in members)}")
    lines = [f"the {what} of pipeline rank {members[0] % p} ({whom}) would hang: "
             f"its members reach different collectives first on the group's one stream, so none completes "
             f"(every member must issue them in one order)"]
    lines += [f"  {who(m)}, rank {m % p}: at {_describe(heads[m])}" for m in members]
    return "\n".join(lines)


def _message(schedule: ScheduleView, posts, pc, queues, p: int, relearn: bool, prefetch: int, ordered: bool,
             communicators: str) -> str:
    order = f"prefetch {prefetch}, {'ordered' if ordered else 'unordered'}"
    which = ("in the first step, which learns shapes (a header before each activation, no prefetch)" if relearn
             else f"from step 2 on ({order})")
    streams = ("each pair of ranks runs its operations in posted order on one stream" if communicators == "pair"
               else "each rank runs all its operations in posted order on the world group's one stream")
    lines = [f"deadlock under NCCL's order {which}: {streams}, and no rank can go on"]
    mark = None
    for g, ps in enumerate(posts):
        replica, r = divmod(g, p)
        who = f"rank {r}" + (f" (replica {replica})" if len(posts) > p else "")
        if pc[g] >= len(ps):
            lines.append(f"  {who}: finished")
            continue
        x = ps[pc[g]]
        what = _describe(x)
        heads = [f"{_describe(q[g][0])} to/from rank {q[g][0].peer % p}" for key, q in queues.items()
                 if key[0] != "group" and q.get(g) and q[g][0].op in ("send", "recv")]
        blocked = f"; its streams start with {', '.join(heads)}" if heads else ""
        lines.append(f"  {who}: stuck at {what}{blocked}")
        if mark is None and x.action is not None and x.action in schedule.ranks[r]:
            mark = (r, _position(schedule, r, x.action))
    lines.append(render_order(schedule, mark=mark))
    return "\n".join(lines)


def _describe(x: Post) -> str:
    if x.op == "coll":
        if x.message and x.message[0] == "ring":
            return f"{x.action!r}'s ring step {x.message[1] + 1} on its CP group"
        if x.message and x.message[0] == "all-to-all":
            return f"{x.action!r}'s all-to-all {x.message[1] + 1} on its EP group"
        if x.message == ("experts",):
            return f"{x.action!r}'s expert-gradient sum over its EDP group"
        if x.message[:1] == ("loads",):
            return f"stage {x.message[1]}'s expert loads' sum over its dp group"
        if x.message == ("aux",):
            return "the auxiliary losses' sum over its dp group"
        return f"{x.action!r}" if x.action is not None else "the agreed update's all-reduce"
    if x.op == "flush":
        return "the end of the step (its sends not yet matched)"
    what = repr(x.action) if x.action is not None else "the fed targets"
    if x.message and x.message[-1] == "header":
        what += "'s shape header"
    return {"send": f"{what} (send)", "recv": f"{what} (posted receive)", "wait": f"{what} (waiting for data)"}.get(
        x.op, what)
