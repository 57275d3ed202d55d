"""The expert all-to-alls a program issues, as the NCCL-order check (``nccl_order.py``) models them.

Note [expert all-to-alls in the order model]
--------------------------------------------
With expert parallelism (``ep > 1``: Note [expert parallelism] in actors/grid.py) every compute
action of a stage with MoE blocks exchanges tokens with the same pipeline rank of the other
members of its EP group (``ep`` consecutive replicas: replica ``d`` is EP rank ``d % ep`` of
group ``d // ep``; with CP the model's replicas are a rank's ``dp x cp`` members, ``replica x cp +
CP rank``, Note [ring exchanges in the order model] in context_order.py).  Per MoE block, in the order the blocks run (actors/experts.py):

* ``F``: three ``all_to_all_single`` on the EP group: the per-expert counts (the host waits for
  them: the split sizes of the next two), the token dispatch, the combine;
* ``B`` and ``I``: two, the combine's and the dispatch's backward (the reverse exchanges), in
  reverse block order; a recomputed stage first runs its forward again (three more per block,
  inside ``B``, or inside ``I``: Note [recompute at I] in actors/stage_exec.py);
* ``W``: none when the split backward is exact (Note [weight seeds] in
  actors/split_backward.py: the weight halves below the expert matmuls need no exchange); two
  per block when it falls back to the plain way, which runs the backward from the stage's
  output again, through both exchanges.  The first stage's ``I`` has no input gradient to
  compute: its ``W`` runs the whole backward (two per block) and its ``I`` only a recomputed
  forward's exchanges.

Which way a stage's backward takes is decided on the actor from its autograd graph, so the
caller says which one it models (``of_blocks(..., split_fallback=...)``) and the engine checks
both (mpmd/runtime/transport.py ``expert_collectives``).  The runtime must take the same way on
every member of an EP group, or one member's ``W`` would exchange and another's not.  Today it
decides per microbatch: ``plan_weight_seeds`` falls back when a parameter sits under two weight
nodes, which ``ExpertParallelExperts`` makes depend on how many of its local experts got rows —
a routing-dependent choice no pre-launch check can prove uniform (docs/moe.md says so).

Each exchange is a collective on the EP group's own communicator (one stream): it completes once
every member has posted it, and the members must post them in one order.  The model treats each
as waited for by the host before the next post, as the counts exchange is; the dispatch and the
combine are not waited for by the host on NCCL, but whatever follows them on any stream depends
on them through the compute that uses them, and each stream's posting order is the same either
way.  Per step, besides: a rank holding experts sums their gradients over its EDP group (the
members holding the same experts, ``d % ep``) right after the dense gradients' dp all-reduce at
its ``ALLREDUCE`` (when ``dp > ep``: actors/dp_reduce.py ``average_experts``); after the agreed
update it sums each MoE stage's expert loads over its dp group, in stage order, then the
auxiliary losses' means (``loads``, ``aux``: actors/expert_setup.py ``ExpertStages.finish_step``).
Each collective is labelled (its action, which of its exchanges) alike on every member, so
members of a group that reach different collectives are refused by name (``nccl_order.py``), and
one order whose exchanges close a cycle with the point-to-point messages is refused as a
deadlock.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

from .actions import Kind

__all__ = ["ExpertCollectives", "EXCHANGE_KINDS", "exchange_order", "check_exchange_order"]

EXCHANGE_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)
FORWARD_EXCHANGES = 3  # counts, dispatch, combine (Note [expert all-to-alls in the order model])
BACKWARD_EXCHANGES = 2  # the combine's and the dispatch's reverse


@dataclasses.dataclass(frozen=True)
class ExpertCollectives:
    """What a program issues on its EP groups (Note [expert all-to-alls in the order model]).

    ``ep``: members per EP group (divides ``dp``, or ``dp x cp`` with a ring); ``per_action``: stage -> {kind: all-to-alls
    one action of that kind issues}; stages missing hold no experts.  ``loads``: after the
    update, each MoE stage's per-expert loads summed over its rank's dp group, in stage order (the
    blocks are watched: ``ep > 1``, an auxiliary loss or the bias update); ``aux``: then the
    auxiliary losses' means, one more sum per rank (actors/expert_setup.py ``finish_step``)."""

    ep: int
    per_action: Mapping[int, Mapping[Kind, int]]
    loads: bool = False
    aux: bool = False
    split_fallback: bool = False  # what ``of_blocks`` modelled: W runs the backward's exchanges again

    def __post_init__(self) -> None:
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"ExpertCollectives.ep must be a positive integer, got {self.ep!r}")
        for stage, kinds in self.per_action.items():
            for kind, n in kinds.items():
                if kind not in EXCHANGE_KINDS or not isinstance(n, int) or n < 0:
                    raise ValueError(f"ExpertCollectives.per_action[{stage}]: expected {{F, B, I, W: count >= 0}}, "
                                     f"got {kind!r}: {n!r}")

    @classmethod
    def of_blocks(cls, ep: int, blocks: Mapping[int, int], *, recomputed: Collection[int] = (),
                  split_fallback: bool = False, no_input_grad: Collection[int] = (0,),
                  loads: bool = False, aux: bool = False) -> "ExpertCollectives":
        """From ``blocks`` (stage -> its MoE blocks): the exchanges each action issues, with
        ``recomputed`` stages running their forward again in ``B`` / ``I``, and ``W`` issuing
        the backward's exchanges again when the split backward falls back (``split_fallback``).
        A stage in ``no_input_grad`` (the first: its inputs are the step's data) has no input
        gradient for ``I`` to compute, so its ``W`` runs the whole backward and its ``I`` only a
        recomputed forward (actors/stage_exec.py ``backward_input``)."""
        out = {}
        for stage, n in blocks.items():
            if n:
                again = FORWARD_EXCHANGES * n if stage in recomputed else 0
                back = BACKWARD_EXCHANGES * n
                whole = stage in no_input_grad
                out[stage] = {Kind.F: FORWARD_EXCHANGES * n, Kind.B: again + back, Kind.I: again + (0 if whole else back),
                              Kind.W: back if split_fallback or whole else 0}
        return cls(ep=ep, per_action=out, loads=loads, aux=aux, split_fallback=split_fallback)

    def exchanges(self, stage: int, kind: Kind) -> int:
        """The all-to-alls one ``kind`` action of ``stage`` issues (0 for non-compute kinds)."""
        return self.per_action.get(stage, {}).get(kind, 0) if self.ep > 1 else 0

    def has_blocks(self, stages: Collection[int]) -> bool:
        """Whether a rank running ``stages`` holds MoE blocks (split over its EP group when ``ep > 1``)."""
        return any(s in self.per_action for s in stages)

    def ep_group(self, replica: int) -> tuple[int, ...]:
        """The replicas of ``replica``'s EP group."""
        first = replica - replica % self.ep
        return tuple(range(first, first + self.ep))

    def edp_group(self, replica: int, dp: int) -> tuple[int, ...]:
        """The replicas holding the same experts as ``replica``."""
        return tuple(range(replica % self.ep, dp, self.ep))


def exchange_order(program, experts: ExpertCollectives) -> list[tuple]:
    """The expert all-to-alls one rank's lowered ``program`` issues, in order: ``(action, j)``
    for its ``j``-th exchange (what the NCCL-order model labels them)."""
    return [(a, j) for a in program for j in range(experts.exchanges(a.stage, a.kind))]


def check_exchange_order(programs, experts: ExpertCollectives) -> None:
    """Raise ``ValueError`` naming the first difference when the members of an EP group would
    issue their all-to-alls in different orders; ``programs[d][r]``: replica ``d``'s lowered
    program of pipeline rank ``r`` (a transport that pairs point-to-point messages by tag, gloo,
    needs only this: Note [expert all-to-alls in the order model])."""
    for d, replica in enumerate(programs):
        first = experts.ep_group(d)[0]
        for r, prog in enumerate(replica):
            mine, theirs = exchange_order(prog, experts), exchange_order(programs[first][r], experts)
            if mine != theirs:
                at = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
                got = lambda seq: f"{seq[at][0]!r}'s all-to-all {seq[at][1] + 1}" if at < len(seq) else "nothing"
                raise ValueError(f"the EP group of pipeline rank {r} would hang: replica {first} issues "
                                 f"{got(theirs)} as its all-to-all number {at + 1} while replica {d} issues "
                                 f"{got(mine)}; every member must issue them in one order")
