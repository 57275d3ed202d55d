"""Warm spare actors: started, idle StageWorkers that a restart uses instead of starting
new processes (``Pipeline(..., spare_actors=N)``, Note [spare actors])."""

from __future__ import annotations

import uuid
from typing import Any

import ray

from actors.grid import DeviceGrid

from . import cluster

__all__ = ["SparePool"]


# Note [spare actors]: a restart (fit's max_restarts) replaces every actor, because the
# communication groups are formed once per set of processes; of its "new actors" seconds
# (bench recovery) most are starting bare processes (placement, fork, importing torch).
# With spare_actors=N the engine keeps spares for actor indices 0..N-1 (N <= the actor
# count): each already constructed for its (replica, rank) and seed, so it is the actor a
# fresh start would give (the constructor seeds torch and touches nothing else that
# differs).  A restart takes them in place of new processes (cluster.create_actors), then
# starts replacements without waiting, after the pipeline is set up (they start while
# training goes on).
#
# Spares reserve no CPUs (num_cpus=0) and sit in no placement group: an idle actor costs
# memory (one imported torch) but no CPU, and a reservation of their own would need twice
# the pipeline's CPUs in the cluster (on one machine sized to the pipeline, Ray could never
# place them).  So a spare cannot take a CPU the pipeline needs.  The pipeline's placement
# group is still created on every launch, with the same bundles: its CPUs stay reserved
# against other Ray work (PipeFill tasks, Ray Data), though the promoted spares run outside
# it, where Ray's scheduler put them (on a multi-node cluster, not necessarily packed).
# GPU pipelines are refused: a process's GPU is fixed when Ray starts it, and a spare
# holding a GPU would take it from the pipeline.  A spare found dead when a restart wants
# it is replaced by a new process for that index.
class SparePool:
    def __init__(self, count: int, grid: DeviceGrid, seed: int) -> None:
        if count > grid.size:
            raise ValueError(f"spare_actors={count} but the pipeline has {grid.size} actors, and a restart replaces "
                             f"all of them at most once at a time; pass spare_actors <= {grid.size}")
        self.count, self.grid, self.seed = count, grid, seed
        self.spares: dict[int, Any] = {}  # actor index -> its idle spare
        self._tag = f"mpmd-spare-{uuid.uuid4().hex[:8]}"
        self._started = 0

    def check_device(self, device: str, num_gpus: float) -> None:
        if self.count and (device != "cpu" or num_gpus):
            raise ValueError(f"spare_actors={self.count} works on CPU only (a spare holding a GPU would take it from "
                             f"the pipeline, Note [spare actors]); pass device='cpu' or spare_actors=0")

    def fill(self, num_cpus: float) -> None:
        """Start (without waiting) a spare for every index 0..count-1 that has none; they run
        as many torch threads as an actor with ``num_cpus`` would (Note [spare threads] in cluster.py)."""
        for i in range(self.count):
            if i not in self.spares:
                self._started += 1
                replica, rank, _ = self.grid.coord(i)
                name = f"{self._tag}-d{replica}-r{rank}-{self._started}"
                self.spares[i] = cluster.start_worker(self.grid, i, device="cpu", seed=self.seed, num_cpus=0,
                                                      num_gpus=0, name=name, runtime_env=cluster.threads_env(num_cpus))

    def wait_started(self) -> None:
        """Wait until every spare has started (benchmarks: a kill finds them warm)."""
        cluster.wait_started(list(self.spares.values()))

    def take_all(self) -> dict[int, Any]:
        """The live spares by actor index, removed from the pool; one found dead is left out
        (its index gets a new process).  One still starting counts: it is ready sooner than
        a new process would be."""
        spares, self.spares = self.spares, {}
        if not spares:
            return spares
        pings = {s.pid.remote(): i for i, s in spares.items()}
        ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=0.5)
        for ping in ready:
            try:
                ray.get(ping)
            except ray.exceptions.RayActorError:
                cluster.teardown([spares.pop(pings[ping])], None, graceful=False)
        return spares

    def close(self) -> None:
        cluster.teardown(list(self.spares.values()), None, graceful=False)
        self.spares = {}
