"""What an actor posts, in which order: the receive prefetch and the step's messages.

One policy, used by the actor (``actors/worker.py``) to decide which receives to post
ahead, and by the NCCL-order check (``nccl_order.py``) to rebuild what the actor posts.

Note [NCCL order]
-----------------
The actors run every point-to-point operation between one pair of ranks on that pair's
own process group, hence one NCCL communicator and one CUDA stream, both directions
together, in the order the rank posts them (Note [point-to-point groups] in
actors/comm.py: on the eagerly initialised world group torch would put every peer's
operations on one stream, a model ``communicators="world"`` also runs); a receive holds
that stream until the peer's matching send has run, and a send until the peer's receive
has.  Collectives (the DP all-reduce, a tie reduction, the agreed update's all-reduce, the
expert all-to-alls: Note [expert all-to-alls in the order model] in expert_order.py; the
ring steps of context parallelism: Note [ring exchanges in the order model] in context_order.py)
hold their group's stream until every member is there.  Gloo instead matches each receive with the peer's send by tag,
whatever else is outstanding.

The actor posts receives ahead of their instruction (``prefetch``: the next ``window``
receives, at the step's start and after each receive) so a transfer overlaps compute.
Posted before the rank's own earlier sends, a receive on NCCL queues *ahead* of them on
the pair's stream: 1F1B on two ranks posts ``RECV_B0, RECV_B1`` on rank 0 before
``SEND_F0``, while rank 1 waits in ``RECV_F0`` for that send: a hang from the second
step on (the first learns shapes and posts nothing ahead).

The order chosen (``ordered=True``, used whenever the transport is NCCL): a receive from
peer q is posted ahead only once every send to q that comes before it in program order
has been posted (the worker asks again after each send).  Each pair's stream then holds
that pair's operations in program order, the order in which the lowering matched them
(Note [deadlock-free ordering] in passes.py), so the global sequence of that Note still
runs to the end: its next transfer is at the head of both ranks' streams for that pair,
since everything before it on either stream is earlier in the sequence.  Posting a
receive early only puts it at the head sooner.  What is lost is little: on NCCL the
host does not wait for a receive (``wait`` orders the compute stream after it), so the
send is posted microseconds later and the receive right after it; receives from other
peers, and from q before the next send to q, are still posted ahead.  One process group
per direction of each pair would lift the rule but doubles NCCL's communicators (each
holds buffers on the GPU), and ``batch_isend_irecv`` fuses only operations posted
together.  Gloo keeps the unordered prefetch (``ordered=False``): tags match there.
Collectives of different groups keep one relative order on every rank (Note [tie
reduction]); NCCL kernels of different communicators are assumed to run concurrently
(true on every GPU with enough SMs for the channels in use).

``simulate_blocking(..., semantics="nccl")`` checks a program under this model; the
engine runs it on every program it installs on NCCL (``mpmd/runtime/compile.py``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from .actions import Action, Kind
from .context_order import RingExchanges, split_forwards
from .expert_order import ExpertCollectives

__all__ = ["PREFETCH", "SEND_KINDS", "RECV_KINDS", "prefetch_ready", "Post", "posts_of_rank"]

PREFETCH = 2  # receives the actor posts ahead (Note [receive prefetch] in actors/transfers.py)
SEND_KINDS = frozenset({Kind.SEND_F, Kind.SEND_B})
RECV_KINDS = frozenset({Kind.RECV_F, Kind.RECV_B})


def prefetch_ready(kinds: Sequence[Kind], peers: Sequence[int], recv_at: Sequence[int], next_recv: int,
                   cursor: int, posted, window: int, ordered: bool) -> list[int]:
    """Positions of the receives to post ahead now, in program order (Note [NCCL order]).

    ``kinds``/``peers``: the program's instruction kinds and peers; ``recv_at``: positions
    of its receives, ``next_recv`` the index (into ``recv_at``) of the next one to run;
    ``cursor``: the first position whose sends are not posted yet; ``posted``: positions
    already posted.  The window is ``recv_at[next_recv:next_recv + window]``; the first
    receive that may not be posted yet stops it (later ones must not overtake it)."""
    out = []
    for pos in recv_at[next_recv:next_recv + window]:
        if pos in posted:
            continue
        if ordered and any(kinds[i] in SEND_KINDS and peers[i] == peers[pos] for i in range(cursor, pos)):
            break
        out.append(pos)
    return out


class Post(NamedTuple):
    """One thing a rank posts, in posting order.

    ``op``: ``"send"`` / ``"recv"`` (enqueued on the pair's queue, the host goes on),
    ``"wait"`` (the rank waits for receive ``ident``), ``"flush"`` (for all its sends),
    ``"coll"`` (a collective on ``group``: enqueued and waited for), ``"compute"`` (local
    work: ``action``).  ``message`` names what travels, for matching."""

    op: str
    action: Optional[Action] = None
    peer: int = -1  # global rank at the other end
    message: tuple = ()
    group: tuple = ()
    ident: int = -1


def posts_of_rank(program: Sequence[Action], peers: Sequence[int], *, replica: int, num_ranks: int,
                  rank: int, window: int, ordered: bool, relearn: bool, fed: Optional[tuple[int, int]],
                  train: bool, experts: Optional[ExpertCollectives] = None, dp: int = 1,
                  ring: Optional[RingExchanges] = None) -> list[Post]:
    """What pipeline rank ``rank`` of replica ``replica`` posts in one step of ``program``
    (its lowered actions; ``peers[i]``: the pipeline rank at the other end of action i), as
    ``actors/worker.py`` does: ``relearn`` (the step that learns shapes: a header before each
    activation, no prefetch), ``fed`` (``(feeding rank, last-stage rank)``: the targets go
    first, Note [fed steps]), the agreed update's all-reduce over every actor when ``train``;
    ``experts``: the EP all-to-alls of its compute, the EDP sum at its ``ALLREDUCE`` and the
    loads' sum after the update, among ``dp`` replicas (Note [expert all-to-alls in the order model]);
    ``ring``: the CP groups' ring steps of its compute, ``replica`` then numbering the ``dp`` members
    of a rank's gradient average, ``replica x cp + CP rank``, of which an EP group is ``ep`` consecutive
    ones (Note [ring exchanges in the order model])."""
    base = replica * num_ranks
    cp = ring.cp if ring is not None else 1
    split = split_forwards(program) if ring is not None else set()
    kinds = [a.kind for a in program]
    recv_at = [i for i, k in enumerate(kinds) if k in RECV_KINDS]
    out: list[Post] = []
    posted: dict[int, int] = {}  # position -> ident
    ident = 0

    def recv(pos: int) -> int:
        nonlocal ident
        a = program[pos]
        out.append(Post("recv", a, base + peers[pos], _message(a, recv=True), ident=ident))
        ident += 1
        return ident - 1

    if fed is not None and fed[0] != fed[1]:
        if rank == fed[0]:
            out += [Post("send", None, base + fed[1], ("targets", "header")), Post("send", None, base + fed[1], ("targets",))]
        elif rank == fed[1]:
            for what in (("targets", "header"), ("targets",)):
                out.append(Post("recv", None, base + fed[0], what, ident=ident))
                out.append(Post("wait", ident=ident))
                ident += 1
    window = 0 if relearn else window
    next_recv = 0

    def prefetch(cursor: int) -> None:
        for pos in prefetch_ready(kinds, peers, recv_at, next_recv, cursor, posted, window, ordered):
            posted[pos] = recv(pos)

    prefetch(0)
    for i, a in enumerate(program):
        k = a.kind
        if k in SEND_KINDS:
            if relearn and k is Kind.SEND_F:
                out.append(Post("send", a, base + peers[i], _message(a, recv=False) + ("header",)))
            out.append(Post("send", a, base + peers[i], _message(a, recv=False)))
            prefetch(i + 1)
        elif k in RECV_KINDS:
            if relearn and k is Kind.RECV_F:
                out.append(Post("recv", a, base + peers[i], _message(a, recv=True) + ("header",), ident=ident))
                out.append(Post("wait", a, ident=ident))
                ident += 1
            got = posted.pop(i) if i in posted else recv(i)
            out.append(Post("wait", a, ident=got))
            next_recv += 1
            prefetch(i + 1)
        elif k is Kind.ALLREDUCE:
            out.append(Post("coll", a, group=("dp", rank)))
            # the EDP group: the members holding the same experts (``replica % ep``); a collective when not one actor
            if experts is not None and experts.ep > 1 and dp // experts.ep > 1 and experts.has_blocks((a.stage,)):
                out.append(Post("coll", a, group=("edp", rank, replica % experts.ep), message=("experts",)))
        elif k is Kind.TIE_REDUCE:
            out.append(Post("coll", a, group=("tie", a.tie_group, replica)))
        else:
            out.append(Post("compute", a))
            steps = ring.action_steps(a, split) if ring is not None else 0
            out += [Post("coll", a, group=("cp", rank, replica // cp), message=("ring", j)) for j in range(steps)]
            # an OVERLAP's parts interleave their exchanges, in one order on every member: both parts' count
            exchanges = sum(experts.exchanges(part.stage, part.kind) for part in a.flat) if experts is not None else 0
            for j in range(exchanges):
                out.append(Post("coll", a, group=("ep", rank, replica // experts.ep), message=("all-to-all", j)))
    out.append(Post("flush"))
    if train:
        out.append(Post("coll", None, group=("world",)))
        if experts is not None and dp > 1:
            out += _expert_sums(program, experts, rank)
    return out


def _expert_sums(program: Sequence[Action], experts: ExpertCollectives, rank: int) -> list[Post]:
    """After the update, on the rank's dp group: each MoE stage's expert loads, in stage order,
    then the auxiliary losses' means (Note [expert all-to-alls in the order model])."""
    mine = sorted({a.stage for a in program if experts.has_blocks((a.stage,))})
    if not mine:
        return []
    loads = [Post("coll", None, group=("dp", rank), message=("loads", s)) for s in mine] if experts.loads else []
    return loads + ([Post("coll", None, group=("dp", rank), message=("aux",))] if experts.aux else [])


def _message(a: Action, *, recv: bool) -> tuple:
    """What a send or receive carries, named by the producing stage: ``("F", s, m)`` is the
    output of stage s's forward of microbatch m, ``("B", s, m)`` the input gradient of stage s."""
    if a.kind in (Kind.SEND_F, Kind.RECV_F):
        return ("F", a.stage - 1 if recv else a.stage, a.microbatch)
    return ("B", a.stage + 1 if recv else a.stage, a.microbatch)
