"""How activations, gradients and all-reduces move between the actors (``transport=``).

``"auto"`` (the default) picks, once the actors are placed:

* on the CPU, gloo;
* on CUDA with every actor on a GPU of its own, NCCL;
* on CUDA with two actors sharing a GPU (fractional ``num_gpus``), gloo through pinned
  host memory (Note [staged transport] in actors/staging.py): NCCL refuses two ranks on one
  device ("Duplicate GPU detected").

``"nccl"`` and ``"gloo"`` force a backend (gloo on CUDA stages through host memory);
``"staged"`` is gloo with every tensor staged even on the CPU, which runs the shared-GPU
path on a machine without one (tests); ``"nccl-order"`` is gloo with each pair's
point-to-point operations run in posted order, each blocking until matched, as NCCL runs
them (Note [NCCL order on the CPU] in actors/pair_queues.py): the actors' NCCL posting
order, run on a machine without GPUs (tests).  What was chosen, and why, is said once.
Each choice names one transport class on the actors (``Transport.kind``, a key of
``actors.transports.TRANSPORTS``), which the actor's Communicator builds once.
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, Optional, Sequence

import schedules
from actors.experts import find_moe_blocks
from actors.program import Instr
from actors.update import Recipe
from actors.transports import TRANSPORTS as TRANSPORT_CLASSES, transport_kind
from schedules import DeadlockError, Schedule

from .checks import warn_user
from .compile import TRAIN
from .cp import attention_calls

__all__ = ["TRANSPORTS", "Transport", "choose_transport", "transport_for", "check_nccl_order", "check_before_launch",
           "check_expert_order", "check_ring_order", "expert_collectives", "pipeline_experts", "ring_exchanges",
           "pipeline_rings"]

TRANSPORTS = ("auto", "nccl", "gloo", "staged", "nccl-order")


class Transport(NamedTuple):
    backend: str  # "nccl" | "gloo"
    staged: bool  # tensors travel through host memory (Note [staged transport])
    reason: str
    queued: bool = False  # point-to-point in NCCL's order over gloo (Note [NCCL order on the CPU])

    @property
    def kind(self) -> str:
        """The actors' transport class this names (``actors.transports.TRANSPORTS``)."""
        return transport_kind(self.backend, staged=self.staged, queued=self.queued)

    @property
    def ordered(self) -> bool:
        """Each pair's operations run in posted order (Note [NCCL order] in schedules/posting.py)."""
        return TRANSPORT_CLASSES[self.kind].ordered


def choose_transport(requested: str, device: str, slots: Sequence[tuple]) -> Transport:
    """``slots[i]``: actor i's ``(node, GPU ids)`` (``StageWorker.gpu_slot``)."""
    if requested == "nccl-order":
        return Transport("gloo", device == "cuda", "transport='nccl-order': gloo, each pair's operations in "
                                                   "posted order as on NCCL", queued=True)
    if requested == "staged":
        return Transport("gloo", True, "transport='staged': gloo, every tensor staged through host memory")
    if device != "cuda":
        if requested == "nccl":
            raise ValueError("transport='nccl' needs device='cuda'; on the CPU use transport='auto' (gloo)")
        return Transport("gloo", False, "gloo on the CPU")
    owners = collections.defaultdict(list)
    for i, (node, gpus) in enumerate(slots):
        for g in gpus:
            owners[(node, g)].append(i)
    shared = {key: actors for key, actors in owners.items() if len(actors) > 1}
    if requested == "gloo":
        return Transport("gloo", True, "transport='gloo': gloo through pinned host memory")
    if not shared:
        return Transport("nccl", False, "NCCL: every actor has a GPU of its own")
    (node, gpu), actors = next(iter(sorted(shared.items())))
    where = f"actors {', '.join(map(str, actors))} share GPU {gpu} on node {node[:8]}"
    if requested == "nccl":
        raise ValueError(f"transport='nccl' cannot join two actors on one GPU ({where}; NCCL refuses a duplicate "
                         f"GPU); give each actor a GPU of its own (num_gpus=1) or use transport='auto'")
    return Transport("gloo", True, f"{where}: activations, gradients and all-reduces go through pinned host "
                                   f"memory over gloo, since NCCL cannot join two ranks on one GPU")


def announce(transport: Transport, device: str) -> None:
    """Say once what was chosen where it is not the obvious choice."""
    if device == "cuda" or transport.staged:
        warn_user(f"transport: {transport.reason}")



def transport_for(actors: Sequence, wait: Callable, requested: str, device: str) -> Transport:
    """Ask the started actors where they sit (on CUDA), choose, and say so."""
    slots = wait([a.gpu_slot.remote() for a in actors], "start-up") if device == "cuda" else []
    transport = choose_transport(requested, device, slots)
    announce(transport, device)
    return transport


def expert_collectives(blocks: dict[int, int], ep: int, *, recomputed=(), loads: bool = False,
                       aux: bool = False) -> list[schedules.ExpertCollectives]:
    """What the order check models of the MoE stages (``blocks``: stage -> its MoE blocks):
    the EP all-to-alls with the split backward exact and falling back, both, and the loads'
    and auxiliary losses' sums after the update (Note [expert all-to-alls in the order model]
    in schedules/expert_order.py); none without MoE blocks, or at ``ep=1`` without those sums."""
    if not any(blocks.values()) or (ep == 1 and not (loads or aux)):
        return []
    return [schedules.ExpertCollectives.of_blocks(ep, blocks, recomputed=recomputed, split_fallback=fallback,
                                                  loads=loads, aux=aux) for fallback in (False, True)]


def pipeline_experts(modules: Sequence, ep: int, recipe: Recipe) -> list[schedules.ExpertCollectives]:
    """``expert_collectives`` of a pipeline's stage ``modules`` (a factory's on meta: its
    structure), trained by ``recipe``: the blocks are watched (their loads summed after each
    update) at ``ep > 1`` or with an auxiliary loss or the bias update (actors/expert_setup.py)."""
    blocks = {s: len(find_moe_blocks(m)) for s, m in enumerate(modules)}
    return expert_collectives(blocks, ep, recomputed=recipe.recompute, loads=ep > 1 or recipe.moe_hooks,
                              aux=recipe.moe_aux_loss_coef > 0)


def ring_exchanges(calls: dict[int, int], cp: int, *, recomputed=(),
                   reductions: Optional[dict[int, int]] = None) -> list[schedules.RingExchanges]:
    """What the order check models of the CP rings (``calls``: stage -> its attention calls per
    forward): the ring steps with the split backward exact and falling back, both (Note [ring
    exchanges in the order model] in schedules/context_order.py); none at ``cp=1``.  Kept without
    any attention call too: the model still numbers a rank's members ``replica x cp + CP rank``
    (an EP group is ``ep`` consecutive members)."""
    if cp == 1:
        return []
    return [schedules.RingExchanges.of_attention(cp, calls, recomputed=recomputed, split_fallback=fallback,
                                                 reductions=reductions or {}) for fallback in (False, True)]


def pipeline_rings(modules: Sequence, cp: int, recipe: Recipe) -> list[schedules.RingExchanges]:
    """``ring_exchanges`` of a pipeline's stage ``modules`` (a factory's on meta), trained by ``recipe``."""
    aux = recipe.moe_aux_loss_coef > 0  # each MoE layer's routed counts summed over the CP group
    return ring_exchanges({s: attention_calls(m) for s, m in enumerate(modules)}, cp, recomputed=recipe.recompute,
                          reductions={s: len(find_moe_blocks(m)) if aux else 0 for s, m in enumerate(modules)})


def _ways(experts: Sequence, rings: Sequence) -> list[tuple]:
    """``(experts, ring)`` pairs to check: each way the split backward may go (exact, falling
    back) with both groups' collectives taking it alike (one W on the actor runs both)."""
    if experts and rings:
        return [(ex, ring) for ex in experts for ring in rings if ex.split_fallback == ring.split_fallback]
    return [(ex, None) for ex in experts] or [(None, ring) for ring in rings] or [(None, None)]


def check_nccl_order(name: str, programs: list[list[Instr]], schedule: Schedule, dp: int,
                     linked: Optional[list] = None, experts: Sequence[schedules.ExpertCollectives] = (),
                     rings: Sequence[schedules.RingExchanges] = ()) -> None:
    """Raise ``DeadlockError`` (naming the program, the step, each rank's stuck action) when
    ``programs`` (compiled, per pipeline rank, from a lowering of ``schedule``) could hang
    under NCCL's order as the actors post it: the first step (shape headers) and later ones
    (receives posted ahead), fed or not (Note [fed steps]), with each of ``experts`` (the EP
    all-to-alls: ``expert_collectives``) and ``rings`` (the CP ring steps, ``dp`` then counting
    a rank's ``dp x cp`` actors: ``ring_exchanges``); ``ValueError`` when they link
    ranks outside ``linked`` (the pairs given groups at launch, Note [point-to-point groups])."""
    ranks = tuple(tuple(ins.action for ins in prog) for prog in programs)
    train = name == TRAIN
    lowered = schedule.replace(ranks=ranks, forward_only=not train)
    missing = sorted(set(schedules.linked_ranks(lowered)) - set(linked)) if linked is not None else []
    if missing:
        raise ValueError(f"the {name!r} program sends between pipeline ranks {missing}, which were given no "
                         f"point-to-point group when the actors started (they link {linked}); start a new Pipeline "
                         f"for this placement of stages")
    for ex, ring in _ways(experts, rings):
        for relearn in (True, False):
            for fed in ((False, True) if train else (False,)):
                try:
                    schedules.simulate_blocking(lowered, semantics="nccl", prefetch=schedules.PREFETCH, dp=dp,
                                                relearn=relearn, fed=fed, train=train, experts=ex, ring=ring)
                except DeadlockError as e:
                    raise DeadlockError(f"the {name!r} program could hang on NCCL{' in fed steps' if fed else ''}"
                                        f"{_with_experts(ex)}{_with_ring(ring)}, so it is not installed; use "
                                        f"transport='gloo' or another schedule. {e}") from None


def check_expert_order(name: str, programs: list[list[Instr]], dp: int,
                       experts: Sequence[schedules.ExpertCollectives]) -> None:
    """On a transport that pairs messages by tag (gloo): every EP group issues its all-to-alls
    in one order on every member (every replica runs ``programs``; Note [expert all-to-alls in
    the order model]).  ``ValueError`` naming the first difference."""
    _one_order(name, programs, dp, experts, schedules.check_exchange_order, _with_experts)


def check_ring_order(name: str, programs: list[list[Instr]], dp: int,
                     rings: Sequence[schedules.RingExchanges]) -> None:
    """On a transport that pairs messages by tag (gloo): every CP group posts its ring steps in one
    order on every member (each of the ``dp`` = ``dp x cp`` members runs ``programs``; Note [ring
    exchanges in the order model]).  ``ValueError`` naming the first difference."""
    _one_order(name, programs, dp, rings, schedules.check_ring_order, _with_ring)


def _one_order(name: str, programs: list[list[Instr]], dp: int, models: Sequence, check: Callable,
               label: Callable) -> None:
    """``check`` (``check_exchange_order`` / ``check_ring_order``) on ``dp`` members running
    ``programs``, for each of ``models``; its ``ValueError`` names the program and the model."""
    ranks = [[ins.action for ins in prog] for prog in programs]
    for model in models:
        try:
            check([ranks] * dp, model)
        except ValueError as e:
            raise ValueError(f"the {name!r} program{label(model)}: {e}") from None


def _with_ring(ring: Optional[schedules.RingExchanges]) -> str:
    if ring is None:
        return ""
    return (f" with the CP ring steps (cp={ring.cp}; the split backward "
            f"{'falling back: W runs the ring again' if ring.split_fallback else 'exact: W runs no ring'})")


def _with_experts(ex: Optional[schedules.ExpertCollectives]) -> str:
    if ex is None or ex.ep == 1:
        return ""
    return (f" with the EP all-to-alls (ep={ex.ep}; the split backward "
            f"{'falling back: W exchanges again' if ex.split_fallback else 'exact: W exchanges nothing'})")


def check_before_launch(requested: str, device: str, num_gpus: float, programs: dict, schedule: Schedule,
                        dp: int, experts: Sequence[schedules.ExpertCollectives] = (),
                        rings: Sequence[schedules.RingExchanges] = ()) -> None:
    """Before any actor starts: check ``programs`` (name -> compiled per rank) under NCCL's
    order when the transport will run in it (``"nccl"``, ``"nccl-order"``, or ``"auto"`` with
    a whole GPU per actor), with the EP all-to-alls of ``experts`` and the CP ring steps of
    ``rings``; on gloo, that the EP and CP groups issue them in one order; ``Engine._ship`` checks
    again whatever is installed later."""
    ordered = requested in ("nccl", "nccl-order") or (requested == "auto" and device == "cuda" and num_gpus >= 1)
    for name, compiled in programs.items():
        if ordered:
            check_nccl_order(name, compiled, schedule, dp, experts=experts, rings=rings)
        else:
            check_expert_order(name, compiled, dp, experts)
            check_ring_order(name, compiled, dp, rings)
