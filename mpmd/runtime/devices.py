"""Where the actors compute: ``device="auto"`` resolved one way for planning and the engine.

``resolve_device`` counts fractional GPUs: on a machine (or Ray cluster) with fewer GPUs
than actors, the actors share them, each asking Ray for ``gpus / actors`` of one (the
transport then goes through host memory, Note [staged transport] in actors/staging.py), and
each actor's caching allocator is held to that share of its GPU
(``torch.cuda.set_per_process_memory_fraction``), which is also what ``schedule="auto"``'s
memory model and PipeFill count as its memory.  A local Ray is started with the GPUs torch
sees (``local_gpus``), not left to detect them.
"""

from __future__ import annotations

import logging
import math
import os
from typing import NamedTuple, Optional

import torch

__all__ = ["Placement", "resolve_device", "local_gpus", "memory_fraction", "ensure_ray"]


class Placement(NamedTuple):
    device: str  # "cpu" | "cuda"
    num_gpus: float  # each actor's Ray GPU resource
    memory_fraction: float  # of its GPU each actor's allocator may use (1.0: all of it)


def local_gpus() -> int:
    """The GPUs this process sees (what a local Ray is started with)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _cluster_gpus() -> float:
    import ray

    return float(ray.cluster_resources().get("GPU", 0.0)) if ray.is_initialized() else float(local_gpus())


def memory_fraction(num_gpus: float) -> float:
    """Each actor's share of its GPU's memory: its share of the GPU (1.0 for one or more)."""
    return min(1.0, num_gpus) if num_gpus > 0 else 1.0


def resolve_device(device: str, num_gpus: Optional[float], num_actors: int,
                   gpus: Optional[float] = None) -> Placement:
    """``device`` (``"auto"``, ``"cuda"`` or ``"cpu"``) and each actor's GPU share for
    ``num_actors`` actors, with ``gpus`` GPUs in all (default: Ray's, or torch's before Ray starts).
    ``num_gpus`` (the user's per-actor share) wins where given."""
    if device == "cpu":
        return Placement("cpu", num_gpus or 0.0, 1.0)
    gpus = _cluster_gpus() if gpus is None else gpus
    if num_gpus is None:
        # Shares Ray can place: whole GPUs when there are enough, else an equal fraction, rounded down.
        num_gpus = 1.0 if gpus >= num_actors else math.floor(gpus / max(num_actors, 1) * 1e4) / 1e4
    fits = num_gpus > 0 and num_gpus * num_actors <= gpus + 1e-9
    if device == "auto" and not fits:
        return Placement("cpu", 0.0, 1.0)
    if device == "cuda" and num_gpus <= 0:
        num_gpus = 1.0  # as before: placement reports the shortage
    return Placement("cuda", num_gpus, memory_fraction(num_gpus))


def ensure_ray(cpus: int, *, object_store_bytes: Optional[int] = None, env: Optional[dict] = None) -> None:
    """Start a local Ray for a command (a benchmark, ``python -m mpmd profile``): ``cpus``
    logical CPUs at least, the GPUs torch sees, one intra-op thread per actor, ``env`` in every
    worker's environment; nothing when one runs.  The actors import this code from where the
    controller does."""
    import ray

    if ray.is_initialized():
        return
    env = {"OMP_NUM_THREADS": "1", **(env or {})}
    if os.environ.get("PYTHONPATH"):
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    store = {"object_store_memory": object_store_bytes} if object_store_bytes else {}
    ray.init(num_cpus=max(os.cpu_count() or 1, cpus), num_gpus=local_gpus(), include_dashboard=False,
             log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": env}, **store)
