"""The ring exchanges of context parallelism, as the NCCL-order check (``nccl_order.py``) models them.

Note [ring exchanges in the order model]
----------------------------------------
With ``cp > 1`` (Note [context-parallel runtime] in actors/cp_runtime.py) every attention call of
a stage passes keys and values round the stage's CP group: the ``cp`` actors of one replica and
pipeline rank (and TP rank) holding the shards of the same sequences.  Each ring step is one
``batch_isend_irecv`` on the CP group's own communicator (a send to the next CP rank, a receive
from the previous one, Note [ring attention] in actors/context.py).  The steps of all the
members' calls make a cycle of sends and receives, so a step completes only once every member
has posted it: the model treats each as a collective of the CP group, labelled (its action,
which of its exchanges) alike on every member, and waited for before the next post (as the
expert all-to-alls: Note [expert all-to-alls in the order model] in expert_order.py).  Per
attention call:

* ``F``: ``cp - 1`` steps (the K/V);
* the backward (``B``, or ``I``): ``2 cp - 1`` (the K/V again, each step followed by the
  dK/dV accumulators one step behind, the last accumulator after the last K/V); a recomputed
  stage first runs its forward again (``cp - 1`` more per call, inside ``B``, or inside ``I``:
  Note [recompute at I] in actors/stage_exec.py);
* ``W``: none when the split backward is exact: the weight seeds' backwards start below the
  attention (Note [weight seeds] in actors/split_backward.py); ``2 cp - 1`` per call when it
  falls back and runs the backward from the stage output again, through every attention.  A
  first stage's ``I`` has no input gradient to compute, so its ``W`` runs the whole backward.

With an auxiliary loss on MoE layers each forward that builds a graph also sums the layer's
routed counts over the CP group (Note [auxiliary loss under CP] in actors/moe_hooks.py), one
more step per MoE layer: in ``F``; for a recomputed stage also in the replay (inside ``B``, or
inside ``I``), and not in an ``F`` whose backward is split, which runs without a graph.

Which way the split backward goes is decided on the actor, so the engine checks both
(mpmd/runtime/transport.py ``ring_exchanges``).  A stage's attention calls per forward are
counted before launch from its modules (mpmd/runtime/cp.py ``attention_calls``).

The model's replicas are the ``dp x cp`` members of a rank's gradient average, numbered as the
grid does (``replica x cp + CP rank``, ``DeviceGrid.reduce_index``): the CP group of model
replica ``i`` is ``i // cp``'s ``cp`` members, an EP group is ``ep`` consecutive members and an
EDP group the members with the same EP rank (``i % ep``: Note [expert parallelism] in
actors/grid.py), so EP and CP groups may share members.  In one action the
model posts the ring's steps before the expert all-to-alls, where the runtime interleaves them
block by block: both orders are one order on every member of each group, which is what the
check proves.  A program whose CP members would post the ring's steps in different orders is
refused, naming the group (``nccl_order.py``); on gloo, which pairs messages by tag, the same
order is still needed (a step's receive would take another call's K/V): ``check_ring_order``.
"""

from __future__ import annotations

import dataclasses
from typing import Collection, Mapping

from .actions import Kind

__all__ = ["RingExchanges", "RING_KINDS", "ring_order", "check_ring_order", "split_forwards"]

RING_KINDS = (Kind.F, Kind.B, Kind.I, Kind.W)


@dataclasses.dataclass(frozen=True)
class RingExchanges:
    """What a program issues on its CP groups (Note [ring exchanges in the order model]).

    ``cp``: actors per CP group; ``per_action``: stage -> {kind: ring steps one action of that
    kind issues}; stages missing have no attention."""

    cp: int
    per_action: Mapping[int, Mapping[Kind, int]]
    split_fallback: bool = False  # what ``of_attention`` modelled: W runs the backward's steps again
    # stage -> the CP sums in its F that a graph-free F (recomputed, split backward) leaves to I's replay
    graphless_sums: Mapping[int, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"RingExchanges.cp must be a positive integer, got {self.cp!r}")
        for stage, kinds in self.per_action.items():
            for kind, n in kinds.items():
                if kind not in RING_KINDS or not isinstance(n, int) or n < 0:
                    raise ValueError(f"RingExchanges.per_action[{stage}]: expected {{F, B, I, W: count >= 0}}, "
                                     f"got {kind!r}: {n!r}")

    @classmethod
    def of_attention(cls, cp: int, calls: Mapping[int, int], *, recomputed: Collection[int] = (),
                     split_fallback: bool = False, no_input_grad: Collection[int] = (0,),
                     reductions: Mapping[int, int] = {}) -> "RingExchanges":
        """From ``calls`` (stage -> attention calls per forward): the ring steps each action
        issues, with ``recomputed`` stages running their forward again in ``B`` / ``I``, and ``W``
        running the backward's again when the split backward falls back (``split_fallback``); a
        stage in ``no_input_grad`` (the first) runs the whole backward in ``W``.  ``reductions``
        (stage -> CP all-reduces per forward that builds a graph: the routed counts of each MoE
        layer with an auxiliary loss, Note [auxiliary loss under CP] in actors/moe_hooks.py) are
        counted as more steps of that forward: in ``F``, or in the replay of a recomputed stage
        (whose ``F`` builds no graph)."""
        out, replayed = {}, {}
        for stage in set(calls) | set(reductions):
            n, sums = calls.get(stage, 0), reductions.get(stage, 0)
            if (n or sums) and cp > 1:
                forward, back = (cp - 1) * n, (2 * cp - 1) * n
                again = forward + sums if stage in recomputed else 0
                whole = stage in no_input_grad
                out[stage] = {Kind.F: forward + sums, Kind.B: again + back,
                              Kind.I: again + (0 if whole else back), Kind.W: back if split_fallback or whole else 0}
                if stage in recomputed and sums:
                    replayed[stage] = sums
        return cls(cp=cp, per_action=out, split_fallback=split_fallback, graphless_sums=replayed)

    def exchanges(self, stage: int, kind: Kind, split: bool = False) -> int:
        """The ring steps one ``kind`` action of ``stage`` issues (0 for non-compute kinds);
        ``split``: an ``F`` whose backward is split (``I`` then ``W``), which for a recomputed
        stage runs without a graph and so sums no routed counts (Note [recompute at I])."""
        if self.cp == 1:
            return 0
        n = self.per_action.get(stage, {}).get(kind, 0)
        return n - self.graphless_sums.get(stage, 0) if split and kind is Kind.F else n

    def action_steps(self, action, split: Collection[tuple]) -> int:
        """The steps one action issues (an OVERLAP: both parts'); ``split``: ``split_forwards``."""
        return sum(self.exchanges(p.stage, p.kind, (p.stage, p.microbatch) in split) for p in action.flat)

    def cp_group(self, member: int) -> tuple[int, ...]:
        """The model replicas (``replica x cp + CP rank``) of ``member``'s CP group."""
        first = member - member % self.cp
        return tuple(range(first, first + self.cp))


def split_forwards(program) -> set[tuple]:
    """``(stage, microbatch)`` of the forwards in ``program`` (one rank's actions) whose backward
    is split: those with an ``I``."""
    return {(p.stage, p.microbatch) for a in program for p in a.flat if p.kind is Kind.I}


def ring_order(program, ring: RingExchanges) -> list[tuple]:
    """The ring steps one rank's lowered ``program`` issues, in order: ``(action, j)`` for its
    ``j``-th step (what the NCCL-order model labels them)."""
    split = split_forwards(program)
    return [(a, j) for a in program for part in a.flat
            for j in range(ring.exchanges(part.stage, part.kind, (part.stage, part.microbatch) in split))]


def check_ring_order(programs, ring: RingExchanges) -> None:
    """Raise ``ValueError`` naming the first difference when the members of a CP group would
    post their ring steps in different orders; ``programs[i][r]``: model replica ``i``'s
    (``replica x cp + CP rank``) lowered program of pipeline rank ``r``."""
    for i, member in enumerate(programs):
        first = ring.cp_group(i)[0]
        for r, prog in enumerate(member):
            mine, theirs = ring_order(prog, ring), ring_order(programs[first][r], ring)
            if mine != theirs:
                at = next((k for k, (x, y) in enumerate(zip(mine, theirs)) if x != y), min(len(mine), len(theirs)))
                got = lambda seq: f"{seq[at][0]!r}'s ring step {seq[at][1] + 1}" if at < len(seq) else "nothing"
                raise ValueError(f"the CP group of pipeline rank {r} (replica {i // ring.cp}) would hang: CP rank 0 "
                                 f"posts {got(theirs)} as its ring step number {at + 1} while CP rank {i % ring.cp} "
                                 f"posts {got(mine)}; every member must post them in one order")
