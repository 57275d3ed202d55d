"""``Fleet``: a pipeline's actors and everything of their lifetime.

It holds what the actors are set up with (the stages or their factories, the optimizer,
loss and LR scheduler factories, the recipe, side inputs, TP plans, the schedule, the
configuration and the compiled programs) and the actors themselves: launching them and
shipping the stage modules and programs, installing a (re)compiled program, restarting
after a failure (with the hooks features register), the warm spares, abort and teardown.
The ``Engine`` holds one and runs the steps on it; ``client.py``'s ``ActorClient`` makes
every other call to its actors.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Optional

import ray

from actors.grid import DeviceGrid
from actors.program import Instr, encode_program
from actors.protocol import CommSetup, StageSetup
from schedules import Schedule, linked_ranks

from . import cluster
from .compile import compile_programs, pipeline_programs
from .config import PipelineConfig, recipe_of
from .devices import resolve_device
from .dispatch import Dispatcher
from .pool import active_pool
from .side import side_spec
from .spares import SparePool
from .stage_source import StageSource
from .state import check_tie_layouts
from .ties import find_ties, tie_groups_of
from .transport import (check_before_launch, check_expert_order, check_nccl_order, check_ring_order, pipeline_experts,
                        pipeline_rings, transport_for)

__all__ = ["Fleet"]


class _PhaseClock:
    """Seconds per start-up phase, in order (``Engine.startup``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now


class Fleet:
    """The actors of one pipeline and what they are set up with (see the module docstring).

    ``source``'s stages run in order under ``schedule``; ``loss_fn``, ``optimizer`` and
    ``lr_scheduler`` are shipped to the actors as given.  Nothing starts until ``start``."""

    def __init__(self, source: StageSource, schedule: Schedule, config: PipelineConfig, *,
                 loss_fn: Optional[Callable], optimizer: Optional[Callable], lr_scheduler: Optional[Callable],
                 tp_plans: Optional[list]) -> None:
        self.source = source  # modules and/or factories (Note [stage factories])
        self.schedule, self.config = schedule, config
        self.loss_fn, self.optimizer_factory, self.lr_scheduler = loss_fn, optimizer, lr_scheduler
        num_stages = len(source.modules)
        self.recipe = recipe_of(config, num_stages)
        self.ties = find_ties(source.modules)  # parameters stages share (Note [tie reduction])
        self.tp_plans = tp_plans or [None] * num_stages  # resolve_plans's (Note [tensor parallelism])
        self.tied_stages = [t.stages for t in self.ties]  # each tie's stages, for lowering
        self.side = side_spec(source.modules, loss_fn)  # the side inputs each stage and the loss take
        self.programs = pipeline_programs(schedule, config.layout.reducing, self.tied_stages)  # by name, one per rank
        # Note [expert all-to-alls in the order model] in schedules/expert_order.py: what the order checks know
        self.experts = pipeline_experts(source.modules, config.layout.ep, self.recipe)
        self.rings = pipeline_rings(source.modules, config.layout.cp, self.recipe)  # Note [ring exchanges in the order model]
        self.actors: list = []
        self.device: Optional[str] = None
        self.transport: Any = None  # transport_for's, once launched
        self.dispatch: Optional[Dispatcher] = None  # issues the steps' calls to these actors
        self.spares = SparePool(config.cluster.spare_actors, self.grid, config.recipe.seed)  # Note [spare actors]
        self.startup: dict[str, float] = {}  # seconds per phase of the last launch
        self._linked: list = []  # pipeline ranks that exchange messages (Note [point-to-point groups])
        self._pg = None
        self._pool = None  # where the actors park at shutdown (Note [reused actors] in pool.py)
        self._restart_hooks: list[Callable[[], None]] = []
        self._closed = False
        self._owns_ray = False

    # -- shape -----------------------------------------------------------------------------------
    @property
    def grid(self) -> DeviceGrid:  # which actor is which, and the groups (Note [device grid])
        layout = self.config.layout
        return DeviceGrid(dp=layout.dp, pp=self.schedule.num_ranks, tp=layout.tp, ep=layout.ep, cp=layout.cp)

    num_actors = property(lambda self: self.grid.size)

    def rank_of(self, actor: int) -> int:
        """The pipeline rank of actor ``actor`` (actors are replica-major)."""
        return self.grid.rank_of(actor)

    def replace_config(self, **changes: Any) -> None:
        """The configuration with ``changes`` (e.g. ``fusion``) from the next step on."""
        self.config = dataclasses.replace(self.config, **changes)

    # -- lifetime --------------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to (or start) Ray, launch the actors and ship modules and programs."""
        cfg = self.config
        self._owns_ray = cluster.connect(cfg.cluster.address, self.num_actors, cfg.cluster.num_cpus)
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise
        cluster.settle_heap()  # Note [first pipeline]

    def _launch(self) -> None:
        cfg = self.config
        clock = _PhaseClock()  # Note [start-up at scale] in mpmd/runtime/cluster.py
        placement = resolve_device(cfg.cluster.device, cfg.cluster.num_gpus, self.num_actors)  # fractional GPUs count (devices.py)
        self.device = device = placement.device
        num_gpus = placement.num_gpus
        self.spares.check_device(device, num_gpus)
        check_before_launch(cfg.comm.transport, device, num_gpus, self.programs, self.schedule, cfg.layout.reducing,
                            self.experts, self.rings)  # Note [NCCL order]
        clock.lap("checks")
        # Note [reused actors] in pool.py: CPU actors of a Ray this engine did not start
        self._pool = active_pool() if device == "cpu" and not num_gpus and not self._owns_ray else None
        self.actors, self._pg = cluster.create_actors(
            grid=self.grid, device=device, num_cpus=cfg.cluster.num_cpus, num_gpus=num_gpus,
            placement=cfg.cluster.placement, seed=cfg.recipe.seed, ready_timeout_s=60.0, spares=self.spares.take_all(),
            pool=self._pool)
        clock.lap("placement")
        self.dispatch = Dispatcher(self.actors, self.schedule, self.grid, self._on_failure)
        address = self.wait([self.actors[0].address.remote()], "start-up")[0]
        clock.lap("first actor")
        self.transport = transport_for(self.actors, self.wait, cfg.comm.transport, device)
        self._linked = linked_ranks(self.schedule)  # Note [point-to-point groups] in actors/comm.py
        # Every actor gets the same message: put once, not pickled into each of N calls (Note [start-up at scale]).
        comm_setup = ray.put(CommSetup(
            world_size=self.num_actors, address=address, backend=self.transport.backend,
            staged=self.transport.staged, queued=self.transport.queued, timeout_s=cfg.comm.timeout_s,
            dp_groups=self.grid.dp_groups(), tie_groups=tie_groups_of(self.ties, self.schedule, self.grid)[0],
            p2p_groups=self.grid.pair_groups(self._linked), ep_groups=self.grid.ep_groups(),
            edp_groups=self.grid.edp_groups()))
        clock.lap("transport")
        self.wait([a.init_comm.remote(comm_setup) for a in self.actors], "forming the communication groups")
        clock.lap("groups")
        self._set_up("shipping modules and programs")
        clock.lap("ship")
        if cfg.dispatch.step_channel:
            self.dispatch.open_channels()
        clock.lap("channels")
        self.spares.fill(cfg.cluster.num_cpus)  # started now, they are ready by the next restart
        self.startup = clock.phases

    def _set_up(self, what: str) -> None:
        cfg, actor_ties = self.config, tie_groups_of(self.ties, self.schedule, self.grid)[1]
        # Each stage pickled on its own: stages sharing a parameter get a copy each (Note [tie reduction]);
        # a factory goes instead of its stage, and the actors build it (Note [stage factories]).
        # Each rank's stages go into Ray's object store once, whatever its replicas and TP ranks.
        shipped, owner, per_rank = [self.source.shipped(s) for s in range(len(self.source.modules))], {}, {}
        for i, actor in enumerate(self.actors):
            modules = {s: shipped[s] for s in self.schedule.stages_of(self.rank_of(i))}
            if self.rank_of(i) not in per_rank:
                per_rank[self.rank_of(i)] = ray.put(modules)
            owner[actor.setup.remote(StageSetup(
                modules=per_rank[self.rank_of(i)], optimizer=self.optimizer_factory, loss_fn=self.loss_fn,
                num_stages=self.schedule.num_stages,  # microbatches: per replica
                num_microbatches=self.schedule.num_microbatches,
                bucket_bytes=cfg.comm.bucket_bytes, overlap_reduce=cfg.comm.overlap_reduce,
                recipe=self.recipe, lr_scheduler=self.lr_scheduler,
                dp=cfg.layout.reducing,  # CP ranks join the average (Note [device grid])
                zero=cfg.layout.zero, ties=tuple(actor_ties[i]), loss_takes=self.side.loss,
                side_takes={s: self.side.stages[s] for s in modules}, document_mask=cfg.layout.document_mask,
                tp_plans={s: self.tp_plans[s] for s in modules} if cfg.layout.tp > 1 else None))] = i
        for name, programs in self.programs.items():
            owner.update(self._ship(name, programs))
        self.wait(list(owner), what, owner=owner)
        self._check_tie_layouts()

    def _check_tie_layouts(self) -> None:
        """A tie sharded alike on all its stages (Note [tensor parallelism])."""
        if self.config.layout.tp == 1 or not self.ties:
            return
        indices = [self.grid.actor(0, r, 0) for r in range(self.grid.pp)]
        self.quiesce()
        calls = {self.actors[i].tie_layouts.remote(): i for i in indices}
        check_tie_layouts(self.ties, self.grid, dict(zip(indices, self.wait(list(calls), "checking the ties",
                                                                             owner=calls))))

    def reschedule(self, schedule: Schedule, config: PipelineConfig) -> None:
        """Set the actors up again, from the stages' first state, to run ``schedule`` (same ranks, dp)."""
        self.schedule, self.config, self.dispatch.schedule = schedule, config, schedule
        self.programs = pipeline_programs(schedule, self.config.layout.reducing, self.tied_stages)
        self._set_up("setting the actors up again")

    def install_program(self, name: str, lowered: Schedule) -> list[list[Instr]]:
        """Compile the lowered schedule ``lowered``, ship it to every actor as program
        ``name`` (kept across restarts); its programs."""
        self.check_open()
        programs = compile_programs(lowered)
        calls = self._ship(name, programs)
        self.wait(list(calls), f"shipping the {name} program", owner=calls)
        self.programs[name] = programs
        return list(programs)

    def _ship(self, name: str, programs: list[list[Instr]]) -> dict:
        """Send program ``name`` to every actor (each actor runs its calls in order, so a
        step issued after this runs it); the calls, mapped to their actors."""
        if self.transport.ordered:  # Note [NCCL order]: refused before any step runs
            check_nccl_order(name, programs, self.schedule, self.config.layout.reducing, self._linked, self.experts,
                             self.rings)
        else:  # gloo pairs messages by tag; the EP and CP groups' collectives still run in posted order
            check_expert_order(name, programs, self.config.layout.reducing, self.experts)
            check_ring_order(name, programs, self.config.layout.reducing, self.rings)
        encoded = [encode_program(p) for p in programs]
        return {a.set_program.remote(name, encoded[self.rank_of(i)]): i for i, a in enumerate(self.actors)}

    # -- waiting -------------------------------------------------------------------------------------
    def wait(self, futures: list, what: str, *, owner: Optional[dict] = None,
             timeout_s: Optional[float] = None) -> list[Any]:
        """Wait for Ray calls to the actors; on the first failure tear the pipeline down and
        raise (``owner`` maps a call to its actor's index, else one call per actor in order)."""
        return self.dispatch.wait(futures, what, timeout_s=timeout_s, owner=owner)

    def quiesce(self) -> None:
        """Wait until every step issued has finished on the actors (results are kept)."""
        if self.dispatch is not None:
            self.dispatch.quiesce(self.config.dispatch.step_timeout_s)

    # -- restarts and teardown -------------------------------------------------------------------
    def on_restart(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after ``restart`` has launched fresh actors (before any step), in
        the order registered."""
        self._restart_hooks.append(hook)

    def restart(self) -> None:
        """A fresh set of actors after a failure (fit's ``max_restarts``); state comes from a checkpoint."""
        self._teardown(graceful=False)
        self._closed = False
        try:
            self._launch()
            for hook in self._restart_hooks:
                hook()
        except BaseException:
            self.shutdown()
            raise

    def abort(self) -> None:
        """Ctrl-C: kill the actors at once (a step may be mid-way); a Ray this pipeline started goes too."""
        self._on_failure()
        self.shutdown()

    def _on_failure(self) -> None:
        """An actor failed: tear every actor down so nothing waits on a dead peer."""
        self._teardown(graceful=False)

    def _teardown(self, *, graceful: bool) -> None:
        """Close the step channels and stop the actors; closed until a restart."""
        if self.dispatch is not None:
            self.dispatch.close()
        if self.actors or self._pg is not None:
            cluster.teardown(self.actors, self._pg, graceful=graceful, pool=self._pool,
                             num_cpus=self.config.cluster.num_cpus)
        self.actors, self._pg, self._closed = [], None, True

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this pipeline is shut down (after shutdown() or an actor failure); create a new one")

    def shutdown(self) -> None:
        """Stop the actors.  A Ray this pipeline did not start keeps running."""
        self._teardown(graceful=True)
        self.spares.close()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
