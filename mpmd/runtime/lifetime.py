"""The lifetime of an ``Engine``'s actors: launching them and shipping the stage modules and
programs, installing a (re)compiled program, restarting after a failure and tearing down.
Mixed into ``mpmd.runtime.engine.Engine``, which owns the stages, schedule, configuration and
programs these methods ship, and the ``Dispatcher`` they wait through."""

from __future__ import annotations

import time
from typing import Callable

import ray

from actors.program import Instr, encode_program
from actors.protocol import CommSetup, StageSetup
from schedules import Schedule, linked_ranks

from . import cluster
from .batches import Batching
from .compile import compile_programs, pipeline_programs, segments
from .config import PipelineConfig
from .devices import resolve_device
from .dispatch import Dispatcher
from .pool import active_pool
from .state import check_tie_layouts
from .ties import tie_groups_of
from .transport import check_before_launch, check_nccl_order, transport_for

__all__ = ["Lifetime"]


class _PhaseClock:
    """Seconds per start-up phase, in order (``Engine.startup``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now


class Lifetime:
    """Start, set up, restart and stop the actors (see the module docstring)."""

    def start(self) -> None:
        """Connect to (or start) Ray, launch the actors and ship modules and programs."""
        cfg = self.config
        self._owns_ray = cluster.connect(cfg.address, self.num_actors, cfg.num_cpus)
        try:
            self._launch()
        except BaseException:
            self.shutdown()
            raise
        cluster.settle_heap()  # Note [first pipeline]

    def _launch(self) -> None:
        cfg = self.config
        clock = _PhaseClock()  # Note [start-up at scale] in mpmd/runtime/cluster.py
        placement = resolve_device(cfg.device, cfg.num_gpus, self.num_actors)  # fractional GPUs count (devices.py)
        self.device = device = placement.device
        num_gpus = placement.num_gpus
        self.spares.check_device(device, num_gpus)
        check_before_launch(cfg.transport, device, num_gpus, self._programs, self.schedule, cfg.dp)  # Note [NCCL order]
        clock.lap("checks")
        # Note [reused actors] in pool.py: CPU actors of a Ray this engine did not start
        self._pool = active_pool() if device == "cpu" and not num_gpus and not self._owns_ray else None
        self.actors, self._pg = cluster.create_actors(
            grid=self.grid, device=device, num_cpus=cfg.num_cpus, num_gpus=num_gpus,
            placement=cfg.placement, seed=cfg.seed, ready_timeout_s=60.0, spares=self.spares.take_all(),
            pool=self._pool)
        clock.lap("placement")
        self._dispatch = Dispatcher(self.actors, self.schedule, self.grid, self._on_failure)
        address = self.wait([self.actors[0].address.remote()], "start-up")[0]
        clock.lap("first actor")
        self.transport = transport_for(self.actors, self.wait, cfg.transport, device)
        self._linked = linked_ranks(self.schedule)  # Note [point-to-point groups] in actors/comm.py
        # Every actor gets the same message: put once, not pickled into each of N calls (Note [start-up at scale]).
        comm_setup = ray.put(CommSetup(
            world_size=self.num_actors, address=address, backend=self.transport.backend,
            staged=self.transport.staged, queued=self.transport.queued, timeout_s=cfg.comm_timeout_s,
            dp_groups=self.grid.dp_groups(), tie_groups=tie_groups_of(self.ties, self.schedule, self.grid)[0],
            p2p_groups=self.grid.pair_groups(self._linked)))
        clock.lap("transport")
        self.wait([a.init_comm.remote(comm_setup) for a in self.actors], "forming the communication groups")
        clock.lap("groups")
        self._set_up("shipping modules and programs")
        clock.lap("ship")
        if cfg.step_channel:
            self._dispatch.open_channels()
        clock.lap("channels")
        self.spares.fill(cfg.num_cpus)  # started now, they are ready by the next restart
        self.startup = clock.phases

    def _set_up(self, what: str) -> None:
        cfg, actor_ties = self.config, tie_groups_of(self.ties, self.schedule, self.grid)[1]
        # Each stage pickled on its own: stages sharing a parameter get a copy each (Note [tie reduction]);
        # a factory goes instead of its stage, and the actors build it (Note [stage factories]).
        # Each rank's stages go into Ray's object store once, whatever its replicas and TP ranks.
        shipped, owner, per_rank = [self.source.shipped(s) for s in range(len(self.stages))], {}, {}
        for i, actor in enumerate(self.actors):
            modules = {s: shipped[s] for s in self.schedule.stages_of(self.rank_of(i))}
            if self.rank_of(i) not in per_rank:
                per_rank[self.rank_of(i)] = ray.put(modules)
            owner[actor.setup.remote(StageSetup(
                modules=per_rank[self.rank_of(i)], optimizer=self.optimizer_factory, loss_fn=self.loss_fn,
                num_stages=self.schedule.num_stages,  # microbatches: per replica
                num_microbatches=cfg.num_microbatches,
                bucket_bytes=cfg.bucket_bytes, overlap_reduce=cfg.overlap_reduce,
                recipe=self.recipe, lr_scheduler=self.lr_scheduler,
                dp=cfg.dp, zero=cfg.zero, ties=tuple(actor_ties[i]), loss_takes=self.side.loss,
                side_takes={s: self.side.stages[s] for s in modules},
                tp_plans={s: self.tp_plans[s] for s in modules} if cfg.tp > 1 else None))] = i
        for name, programs in self._programs.items():
            owner.update(self._ship(name, programs))
        self.wait(list(owner), what, owner=owner)
        check_tie_layouts(self)  # a tie sharded alike on all its stages (Note [tensor parallelism])

    def reschedule(self, schedule: Schedule, config: PipelineConfig, batching: Batching) -> None:
        """Set the actors up again, from the stages' first state, to run ``schedule`` (same ranks, dp)."""
        self.schedule, self.config, self._dispatch.schedule, self.batching = schedule, config, schedule, batching
        self._programs = pipeline_programs(schedule, self.config.dp, self._tied)
        self._first_inputs, self._signatures, self.step_count, self.skipped_steps = None, {}, 0, []
        self._set_up("setting the actors up again")

    def install_program(self, name: str, lowered: Schedule) -> list[list[Instr]]:
        """Compile the lowered schedule ``lowered``, ship it to every actor as program
        ``name`` (kept across restarts) and use it from the next step; its programs."""
        self.check_open()
        programs = compile_programs(lowered)
        calls = self._ship(name, programs)
        self.wait(list(calls), f"shipping the {name} program", owner=calls)
        self._programs[name] = programs
        return list(programs)

    def _ship(self, name: str, programs: list[list[Instr]]) -> dict:
        """Send program ``name`` to every actor (each actor runs its calls in order, so a
        step issued after this runs it); the calls, mapped to their actors."""
        if self.transport.ordered:  # Note [NCCL order]: refused before any step runs
            check_nccl_order(name, programs, self.schedule, self.config.dp, self._linked)
        encoded = [encode_program(p) for p in programs]
        self._segments[name] = [segments(p, self.config.fusion) for p in programs]
        return {a.set_program.remote(name, encoded[self.rank_of(i)]): i for i, a in enumerate(self.actors)}

    def on_restart(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` after ``restart`` has launched fresh actors (before any step)."""
        self._restart_hooks.append(hook)

    def restart(self) -> None:
        """A fresh set of actors after a failure (fit's ``max_restarts``); state comes from a checkpoint."""
        self._teardown(graceful=False)
        self._closed, self._signatures = False, {}
        try:
            self._launch()
            for hook in self._restart_hooks:
                hook()
        except BaseException:
            self.shutdown()
            raise

    def abort(self) -> None:
        """Ctrl-C: kill the actors at once (a step may be mid-way); a Ray this engine started goes too."""
        self._on_failure()
        self.shutdown()

    def _on_failure(self) -> None:
        """An actor failed: tear every actor down so nothing waits on a dead peer."""
        self._teardown(graceful=False)

    def _teardown(self, *, graceful: bool) -> None:
        """Close the step channels and stop the actors; the engine is closed until a restart."""
        if self._dispatch is not None:
            self._dispatch.close()
        if self.actors or self._pg is not None:
            cluster.teardown(self.actors, self._pg, graceful=graceful, pool=self._pool,
                             num_cpus=self.config.num_cpus)
        self.actors, self._pg, self._closed = [], None, True

    @property
    def closed(self) -> bool:
        return self._closed

    def check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this pipeline is shut down (after shutdown() or an actor failure); create a new one")

    def shutdown(self) -> None:
        """Stop the actors.  A Ray this engine did not start keeps running."""
        self._teardown(graceful=True)
        self.spares.close()
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False
