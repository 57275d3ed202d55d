"""An actor's stages and what trains them, as one ``StageSetup`` message makes them.

``Stages`` holds the modules, one optimizer (and LR scheduler) per stage, ZeRO-1's shards,
the ties' local copies and the stages' overlapped dp reductions, with the training options
that came with them.  ``build_stages`` makes it on the actor; a worker not set up yet holds
an empty one.  ``StageWorker.setup`` builds a new one each time (``reschedule`` sets the
actors up again), disarming the last one's reductions first."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from .build import load_stage
from .comm import Communicator
from .cp_runtime import use_ring_attention
from .dp_reduce import stage_reductions
from .expert_setup import ExpertStages
from .place import ActorPlace
from .protocol import StageSetup
from .tensor_parallel import apply_plan, check_optimizer
from .ties import TiedCopies
from .update import LossScale, Recipe, autocast_dtype, counted_params
from .zero import build_optimizers

__all__ = ["Stages", "build_stages"]


@dataclasses.dataclass(kw_only=True)
class Stages:
    """The stages on one actor (empty before ``setup``)."""

    modules: dict[int, torch.nn.Module] = dataclasses.field(default_factory=dict)
    # One optimizer per stage (per-parameter optimizers such as AdamW behave the same), so a
    # stage's optimizer state moves with it to any actor layout (mpmd/checkpoint.py); under
    # zero=1 a shard of it (``zero``: stage -> ZeroStage, Note [ZeRO-1 sharding] in actors/zero.py).
    optimizers: dict[int, torch.optim.Optimizer] = dataclasses.field(default_factory=dict)
    zero: dict = dataclasses.field(default_factory=dict)
    schedulers: dict = dataclasses.field(default_factory=dict)  # stage -> its optimizer's LR scheduler
    tied: dict[int, TiedCopies] = dataclasses.field(default_factory=dict)  # tie index -> its local copies
    reductions: dict = dataclasses.field(default_factory=dict)  # stage -> StageReduction (Note [overlapped dp reduction])
    counted: list = dataclasses.field(default_factory=list)  # the parameters this actor adds to the gradient norm
    experts: Optional[ExpertStages] = None  # the MoE blocks' expert parameters and watched routers
    recipe: Recipe = Recipe()
    dp: int = 1
    loss_scale: Optional[LossScale] = None  # fp16's
    autocast: Optional[tuple] = None  # (device type, dtype) the forward runs under, if any
    loss_fn: Optional[Callable] = None
    num_stages: int = 0
    num_microbatches: int = 1
    bucket_bytes: int = 0
    side_takes: dict = dataclasses.field(default_factory=dict)  # stage -> side inputs its forward takes
    loss_takes: Optional[tuple] = ()  # the side inputs the loss takes (None: all)
    document_mask: bool = False  # Note [context-parallel runtime] in actors/cp_runtime.py

    def disarm(self) -> None:
        """Remove any reduction hooks a failed or replaced step left on the parameters."""
        for red in self.reductions.values():
            red.disarm()

    def tie_layouts(self) -> dict:
        """Per tie here, how a TP plan laid out its parameters (the engine compares across actors)."""
        return {i: t.layouts() for i, t in self.tied.items()}


def build_stages(setup: StageSetup, place: ActorPlace, comm: Communicator) -> Stages:
    """The stages ``setup`` describes, on ``place.device``."""
    modules = setup.modules
    if not isinstance(modules, dict):  # a Ray reference, put once per rank (StageSetup)
        import ray

        modules = ray.get(modules)
    # Under TP a stage is sharded before it moves to the device, or built sharded (Note
    # [sharded build] in actors/build.py; Note [tensor parallelism] in actors/tensor_parallel.py).
    built = {int(s): load_stage(int(s), m, place.device, place.global_rank,
                                shard=_plan_of(int(s), setup.tp_plans, comm))
             for s, m in sorted(modules.items())}
    tied = {tie.index: TiedCopies(tie, built) for tie in setup.ties}
    if place.grid.cp > 1 or setup.document_mask:  # Note [context-parallel runtime] in actors/cp_runtime.py
        for m in built.values():
            use_ring_attention(m)
    for m in built.values():
        m.train()
    grid = place.grid  # Note [expert parallelism] in actors/grid.py: experts sharded before the optimizers
    experts = ExpertStages(built, ep=grid.ep, ep_rank=grid.ep_rank(place.replica, place.cp_rank), group=comm.ep_group,
                           recipe=setup.recipe, dp=setup.dp, zero=setup.zero, edp_size=comm.edp_size)
    tied_ids = {id(p) for t in tied.values() for copies in t.copies for p in copies}
    optimizers, zero = build_optimizers(built, setup.optimizer, grid.reduce_index(place.replica, place.cp_rank),
                                        setup.dp, setup.zero, tied_ids,
                                        experts.ids)
    for s, opt in optimizers.items():
        check_optimizer(opt, s)  # kernels DTensor cannot run (Note [tensor parallelism])
    dtype = autocast_dtype(setup.recipe.precision)
    return Stages(
        modules=built, optimizers=optimizers, zero=zero, tied=tied,
        schedulers={s: setup.lr_scheduler(opt) for s, opt in optimizers.items()} if setup.lr_scheduler else {},
        reductions=stage_reductions(built, zero, comm, setup.bucket_bytes, experts.ids)
        if setup.overlap_reduce else {},
        experts=experts,
        counted=counted_params(built, setup.ties, zero if setup.zero else None, place.tp_rank),
        recipe=setup.recipe, dp=setup.dp, loss_scale=LossScale() if setup.recipe.precision == "fp16" else None,
        autocast=(place.device.type, dtype) if dtype is not None else None, loss_fn=setup.loss_fn,
        num_stages=setup.num_stages, num_microbatches=setup.num_microbatches, bucket_bytes=setup.bucket_bytes,
        side_takes=setup.side_takes or {}, loss_takes=setup.loss_takes, document_mask=setup.document_mask)


def _plan_of(s: int, tp_plans: Optional[dict], comm: Communicator) -> Optional[Callable[[Any], None]]:
    """Stage ``s``'s TP plan as a function of its module (None without TP)."""
    if not tp_plans:
        return None
    return lambda module: apply_plan(module, tp_plans.get(s), comm.tp_mesh, s)
