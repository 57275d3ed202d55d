"""Where a ``StageWorker`` sits: its coordinates in the device grid and its device.

``ActorPlace`` is fixed for the actor's life in a pipeline (a reused process gets a new one:
Note [reused actors] in mpmd/runtime/pool.py), and every component of the worker that needs
to know who it is takes it explicitly."""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import torch

from .grid import DeviceGrid

__all__ = ["ActorPlace", "cuda_index", "actor_gpu", "limit_memory"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorPlace:
    """One actor's place: pipeline rank, data-parallel replica and TP rank in ``grid`` (Note
    [device grid] in actors/grid.py), its index among all actors, and its device."""

    rank: int
    replica: int
    tp_rank: int
    cp_rank: int = 0  # context-parallel rank (Note [device grid] in actors/grid.py)
    grid: DeviceGrid
    global_rank: int  # the actor's index in the controller's list (replica-major): ``grid.actor(...)``
    device: torch.device
    memory_fraction: float = 1.0  # of its GPU this actor's allocator may use (limit_memory)


def cuda_index(environ=os.environ, gpu_ids=None) -> Optional[int]:
    """This actor's GPU among those it sees, when Ray left ``CUDA_VISIBLE_DEVICES`` as it was
    (``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1``: every actor sees every GPU, and device
    0 would be every actor's): the GPU Ray assigned (``ray.get_gpu_ids()``, an index among the
    node's GPUs), placed among the visible ones.  None where Ray made the actor's GPU its only
    visible one (device 0) or assigned none."""
    if environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "0").lower() not in ("1", "true"):
        return None
    if gpu_ids is None:
        import ray

        gpu_ids = ray.get_gpu_ids()
    if not gpu_ids:
        return None
    mine = str(gpu_ids[0])
    visible = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if not visible:
        return int(mine)
    if mine not in visible:
        raise RuntimeError(f"Ray assigned GPU {mine} to this actor, which "
                           f"CUDA_VISIBLE_DEVICES={','.join(visible)} hides")
    return visible.index(mine)


def actor_gpu() -> int:
    """This actor's GPU (``cuda_index``), made the current device."""
    index = cuda_index()
    if index is not None:
        torch.cuda.set_device(index)
    return torch.cuda.current_device()


def limit_memory(device: torch.device, fraction: float) -> float:
    """Hold this process's caching allocator on ``device`` to ``fraction`` of the GPU (actors
    sharing one GPU, mpmd/runtime/devices.py): one actor cannot take the others' memory, and
    running out is this actor's out-of-memory error.  The fraction in force."""
    if device.type == "cuda" and fraction < 1.0:
        torch.cuda.set_per_process_memory_fraction(fraction, device)
        return fraction
    return 1.0
