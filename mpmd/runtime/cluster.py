"""Ray plumbing: connect or start Ray, place actors, form the communication groups."""

from __future__ import annotations

import gc
import logging
import math
import os
import uuid
from typing import Any, Optional

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.grid import DeviceGrid
from actors.worker import StageWorker

from .devices import local_gpus, memory_fraction
from .pool import ActorPool

__all__ = ["connect", "create_actors", "bundle_of", "start_worker", "wait_started", "worker_args", "threads_env", "teardown", "settle_heap"]

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


# Note [start-up at scale]: what starting N actors costs, phase by phase (`Fleet.startup`
# times them; `python -m mpmd bench startup` measures them; docs/cluster.md models 1,024 and
# 4,096 actors).  Per actor, only one thing grew faster than N: the groups.  Every actor
# entered `new_group` for all ~1.2N groups of the grid, and on NCCL each such call is a
# world-wide ncclCommSplit, so N such splits per actor; now gloo actors form only their own
# groups and NCCL actors split the world a handful of times (Note [group formation] in
# actors/group_plan.py).  Linear per actor, and left so: the world group itself (gloo
# connects every pair of actors through the TCP store on rank 0, NCCL's bootstrap rings all N)
# and each actor reading the group lists (put into Ray's store once, not pickled into each of
# N calls).  Linear in total on the controller: the placement group (one bundle per TP group),
# one creation call, one init_comm, one setup and one set_program per program per actor, the
# NCCL-order check of the programs (it simulates every replica).
# Note [first pipeline]: the first pipeline after `ray.init` ran its first steps ~3x slower
# than the next pipeline's (issue 34).  The cause was the controller's own heap: importing
# torch and ray and starting Ray leave ~220k young objects, and CPython's first full
# (generation 2) collection then came during the first pipeline's steps: one pause of
# 200-370 ms on this project's 2-core machine under load (gc.callbacks: one such pause in
# the first pipeline's first 40-100 steps, none in later pipelines').  A full collection
# once the actors are up, before the first step, takes that pause at construction; the
# survivors then count as long-lived, and the next full collection waits until a quarter
# as many again have piled up, which steady-state steps do not do.
# `python -m mpmd bench first` measures it (first against second pipeline, with and without).
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
                  placement: str, seed: int, ready_timeout_s: float, spares: Optional[dict[int, Any]] = None,
                  pool: Optional[ActorPool] = None):
    """One actor per grid cell (Note [device grid]): each TP group (one pipeline rank of one
    replica) in its own placement-group bundle, so a TP group is on one node and its
    collectives stay on its fast links.  ``spares`` maps indices to started actors to use
    instead of new ones (Note [spare actors]).

    Bundles are ordered as ``bundle_of`` says (Note [expert placement]): with
    ``placement="pack"`` adjacent bundles share a node where they fit, so a replica's pipeline
    ranks (at ``ep=1``), or an EP group's replicas of one rank (at ``ep > 1``), stay on one node;
    ``"spread"`` puts bundles on as many nodes as it can.  Actors are named
    ``mpmd-<id>-d<replica>-r<rank>[-t<tp rank>]`` so they can be found in a shared cluster.
    With ``pool`` (CPU only), parked actors are rebound first and every new actor is one a
    pool can keep (Note [reused actors] in pool.py): outside the group, ``num_cpus=0``.
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
    reused = pool.take(threads_env(num_cpus), world - len(spares or {})) if pool is not None else []
    for i in range(world):
        actor = (spares or {}).get(i)
        if actor is None and reused:
            actor = reused.pop(0)  # in the order they parked: a pipeline like the last keeps its places
            actor.rebind.remote(**worker_args(grid, i, device, seed, num_gpus))
        elif actor is None and pool is not None:
            (d, r, t), c = grid.coord(i), grid.cp_rank_of(i)
            actor = start_worker(grid, i, device=device, seed=seed, num_cpus=0, num_gpus=0,
                                 name=f"{tag}-d{d}-r{r}" + (f"-c{c}" if grid.cp > 1 else "") + (f"-t{t}" if grid.tp > 1 else ""),
                                 runtime_env=threads_env(num_cpus))
        elif actor is None:
            strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundle_of(grid, i))
            (d, r, t), c = grid.coord(i), grid.cp_rank_of(i)
            actor = start_worker(grid, i, device=device, seed=seed, num_cpus=num_cpus, num_gpus=num_gpus,
                                 name=f"{tag}-d{d}-r{r}" + (f"-c{c}" if grid.cp > 1 else "") + (f"-t{t}" if grid.tp > 1 else ""), scheduling_strategy=strategy)
        actors.append(actor)
    return actors, pg


# Note [expert placement]: Ray's PACK strategy fills nodes with the placement group's bundles
# in order, so the bundle order says which actors share a node.  At ``ep=1`` bundle k is TP
# group k of the grid (replica-major: a replica's pipeline ranks side by side, point-to-point
# traffic on a node's links).  At ``ep > 1`` the all-to-alls dominate: per MoE layer, F sends
# each token's hidden state to ``top_k`` experts and back and B does it again, where a stage
# boundary sends one activation per microbatch; so, as Megatron-Core orders its ranks (EP inside
# the node, PP across), an EP group's ``ep`` members (of the rank's dp x cp actors, Note [expert
# parallelism] in actors/grid.py) take adjacent bundles: EP group g, rank r, EP rank e is bundle
# ``(g * pp + r) * ep + e`` (a CP group shares a node when it lies inside an EP group).  With ``ep * tp`` devices or
# fewer per node each EP group then sits on one node (when the node's size is a multiple of it);
# the pipeline's point-to-point hops cross nodes instead, and the grid itself (which actor is
# which world rank) does not change.  PACK orders but does not promise: a cluster whose free
# devices are scattered may still split a group, as it may split a replica's pipeline today.
def bundle_of(grid: DeviceGrid, actor: int) -> int:
    """The placement-group bundle of ``actor`` (Note [expert placement]); each holds one TP group
    (of one CP rank)."""
    if grid.ep == 1:
        return actor // grid.tp
    d, r, _ = grid.coord(actor)
    group, e = divmod(grid.reduce_index(d, grid.cp_rank_of(actor)), grid.ep)
    return (group * grid.pp + r) * grid.ep + e


def start_worker(grid: DeviceGrid, i: int, *, device: str, seed: int, num_cpus: float, num_gpus: float, name: str,
                 scheduling_strategy: Any = None, runtime_env: Optional[dict] = None):
    """Start (without waiting) the StageWorker for index ``i`` of ``grid``."""
    options = {k: v for k, v in (("scheduling_strategy", scheduling_strategy), ("runtime_env", runtime_env)) if v}
    return _RemoteWorker.options(num_cpus=num_cpus, num_gpus=num_gpus, name=name, max_restarts=0, max_task_retries=0,
                                 **options).remote(**worker_args(grid, i, device, seed, num_gpus))


def wait_started(handles: list) -> None:
    """Wait until every actor of ``handles`` has started (answered a call)."""
    ray.get([a.pid.remote() for a in handles])


def worker_args(grid: DeviceGrid, i: int, device: str, seed: int, num_gpus: float) -> dict:
    """The ``StageWorker`` constructor's arguments for index ``i`` of ``grid``."""
    (replica, rank, tp_rank), cp_rank = grid.coord(i), grid.cp_rank_of(i)
    return dict(rank=rank, replica=replica, num_ranks=grid.pp, dp=grid.dp, tp=grid.tp, tp_rank=tp_rank, ep=grid.ep,
                cp=grid.cp, cp_rank=cp_rank,
                device=device, seed=seed, memory_fraction=memory_fraction(num_gpus) if device == "cuda" else 1.0,
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


def teardown(actors, pg, graceful: bool, pool: Optional[ActorPool] = None, num_cpus: float = 1.0) -> None:
    """Stop ``actors`` (``graceful``: they close their groups first; with ``pool`` they park
    there instead, as many as it keeps) and remove the placement group ``pg``."""
    if graceful and pool is not None:
        actors = pool.give(threads_env(num_cpus), actors)
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


# Note [spare threads]: Ray sets a worker's OMP_NUM_THREADS (torch's intra-op threads) to
# its CPU count, at least 1, unless the environment sets it.  A spare (or an actor a pool
# may keep, Note [reused actors]) has num_cpus=0 and so would run 1 thread where an actor
# with num_cpus=4 runs 4: slower, and a reduction split over other threads may round
# differently.  Unless the job's runtime_env or the controller's environment (which a Ray
# started here passes on) sets the variable, and so every worker has it, such an actor gets
# the value Ray gives the pipeline's actors.  (Left: a cluster started elsewhere with the
# variable set while the controller's is unset.)
def threads_env(num_cpus: float) -> Optional[dict]:
    """The runtime_env of an actor outside the placement group that runs as many torch threads
    as one with ``num_cpus`` (Note [spare threads]); None where every worker has them already."""
    if "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in (
            ray.get_runtime_context().runtime_env or {}).get("env_vars", {}):
        return None
    return {"env_vars": {"OMP_NUM_THREADS": str(max(math.floor(num_cpus), 1))}}
