"""Ray plumbing: connect or start Ray, place actors, form the communication groups."""

from __future__ import annotations

import gc
import logging
import os
import uuid
from typing import Any, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.grid import DeviceGrid
from actors.worker import StageWorker

from .devices import local_gpus, memory_fraction

__all__ = ["connect", "create_actors", "start_worker", "teardown", "settle_heap"]

_RemoteWorker = ray.remote(StageWorker)


def connect(address: str | None, actors_needed: int, cpus_per_actor: float) -> bool:
    """Reuse an initialised Ray, attach to ``address``, or start a local one sized so
    the actors fit.  Returns whether this call opened the connection (and so should
    close it); an attached cluster itself is never shut down by us."""
    if ray.is_initialized():
        return False
    if address is None:
        cpus = max(os.cpu_count() or 1, int(actors_needed * cpus_per_actor + 0.999))
        ray.init(num_cpus=cpus, num_gpus=local_gpus(), include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=True, configure_logging=True)
    else:
        try:
            ray.init(address=address, logging_level=logging.WARNING)
        except ConnectionError as e:
            raise ConnectionError(_attach_hint(address, e)) from e
    return True


# Note [first pipeline]: the first pipeline after `ray.init` ran its first steps ~3x slower
# than the next pipeline's (issue 34).  The cause was the controller's own heap: importing
# torch and ray and starting Ray leave ~220k young objects, and CPython's first full
# (generation 2) collection then came during the first pipeline's steps: one pause of
# 200-370 ms on this project's 2-core machine under load (gc.callbacks: one such pause in
# the first pipeline's first 40-100 steps, none in later pipelines').  A full collection
# once the actors are up, before the first step, takes that pause at construction; the
# survivors then count as long-lived, and the next full collection waits until a quarter
# as many again have piled up, which steady-state steps do not do.
# `python -m mpmd bench-first` measures it (first against second pipeline, with and without).
def settle_heap() -> None:
    """A full garbage collection now, off the steps' path (Note [first pipeline])."""
    gc.collect()


def _attach_hint(address: str, error: BaseException) -> str:
    causes, e = [], error
    while e is not None:
        causes.append(str(e))
        e = e.__cause__ or e.__context__
    text = " ".join(causes).lower()
    if "auth" in text and os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        # Ray enables token authentication by itself only for address=None/"auto".
        return (f"could not attach to the Ray cluster at {address!r}: it requires token authentication "
                f"(the default of `ray start`). Set RAY_AUTH_MODE=token and make the cluster's token "
                f"available (~/.ray/auth_token or RAY_AUTH_TOKEN), or pass address='auto' on the head node")
    return (f"could not attach to the Ray cluster at {address!r} ({error}); check that it is running: "
            f"`ray status --address={address}`")


def create_actors(*, grid: DeviceGrid, device: str, num_cpus: float, num_gpus: float,
                  placement: str, seed: int, ready_timeout_s: float, spares: Optional[dict[int, Any]] = None):
    """One actor per grid cell (Note [device grid]): each TP group (one pipeline rank of one
    replica) in its own placement-group bundle, so a TP group is on one node and its
    collectives stay on its fast links.  ``spares`` maps indices to started actors to use
    instead of new ones (Note [spare actors]).

    Bundle k holds TP group k, so with ``placement="pack"`` a replica's pipeline ranks
    (adjacent bundles) share a node where they fit and point-to-point traffic stays
    local; ``"spread"`` puts bundles on as many nodes as it can.  Actors are named
    ``mpmd-<id>-d<replica>-r<rank>[-t<tp rank>]`` so they can be found in a shared cluster.
    """
    world = grid.size
    _check_resources(world, num_cpus, num_gpus)
    bundle = {"CPU": num_cpus * grid.tp} if num_cpus else {}
    if num_gpus:
        bundle["GPU"] = num_gpus * grid.tp
    tag = f"mpmd-{uuid.uuid4().hex[:8]}"
    pg = placement_group([dict(bundle) or {"CPU": 0.001}] * (world // grid.tp),
                         strategy="PACK" if placement == "pack" else "SPREAD", name=tag)
    ready, _ = ray.wait([pg.ready()], timeout=ready_timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise RuntimeError(
            f"the cluster could not place {world} actors ({bundle} each, placement={placement!r}) within "
            f"{ready_timeout_s:.0f}s; free resources, lower num_cpus/num_gpus per actor"
            + (", or use placement='pack'" if placement == "spread" else ", or use fewer actors")
        )
    actors = []
    for i in range(world):
        actor = (spares or {}).get(i)
        if actor is None:
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i // grid.tp)
            d, r, t = grid.coord(i)
            actor = start_worker(grid, i, device=device, seed=seed, num_cpus=num_cpus, num_gpus=num_gpus,
                                 name=f"{tag}-d{d}-r{r}" + (f"-t{t}" if grid.tp > 1 else ""), scheduling_strategy=strategy)
        actors.append(actor)
    return actors, pg


def start_worker(grid: DeviceGrid, i: int, *, device: str, seed: int, num_cpus: float, num_gpus: float, name: str,
                 scheduling_strategy: Any = None, runtime_env: Optional[dict] = None):
    """Start (without waiting) the StageWorker for index ``i`` of ``grid``."""
    replica, rank, tp_rank = grid.coord(i)
    options = {k: v for k, v in (("scheduling_strategy", scheduling_strategy), ("runtime_env", runtime_env)) if v}
    return _RemoteWorker.options(num_cpus=num_cpus, num_gpus=num_gpus, name=name, max_restarts=0, max_task_retries=0,
                                 **options).remote(
        rank=rank, replica=replica, num_ranks=grid.pp, dp=grid.dp, tp=grid.tp, tp_rank=tp_rank, device=device, seed=seed,
        memory_fraction=memory_fraction(num_gpus) if device == "cuda" else 1.0,
        niceness=os.getpriority(os.PRIO_PROCESS, 0))  # Note [worker niceness] in actors/process.py


def _check_resources(world: int, num_cpus: float, num_gpus: float) -> None:
    total = ray.cluster_resources()
    for name, per in (("CPU", num_cpus), ("GPU", num_gpus)):
        need, have = per * world, total.get(name, 0.0)
        if need > have + 1e-9:
            raise ValueError(
                f"the pipeline needs {need:g} {name}s ({world} actors x {per:g}) but the Ray cluster has {have:g}; "
                f"pass num_{name.lower()}s={have / world:.2g} per actor or fewer actors"
            )


def teardown(actors, pg, graceful: bool) -> None:
    if graceful:
        try:
            ray.get([a.shutdown.remote() for a in actors], timeout=10)
        except Exception:  # noqa: BLE001 - best effort; the kill below is what counts
            pass
    for a in actors:
        try:
            ray.kill(a, no_restart=True)
        except Exception:  # noqa: BLE001
            pass
    if pg is not None:
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001
            pass
