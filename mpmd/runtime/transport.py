"""How activations, gradients and all-reduces move between the actors (``transport=``).

``"auto"`` (the default) picks, once the actors are placed:

* on the CPU, gloo;
* on CUDA with every actor on a GPU of its own, NCCL;
* on CUDA with two actors sharing a GPU (fractional ``num_gpus``), gloo through pinned
  host memory (Note [staged transport] in actors/comm.py): NCCL refuses two ranks on one
  device ("Duplicate GPU detected").

``"nccl"`` and ``"gloo"`` force a backend (gloo on CUDA stages through host memory);
``"staged"`` is gloo with every tensor staged even on the CPU, which runs the shared-GPU
path on a machine without one (tests).  What was chosen, and why, is said once.
"""

from __future__ import annotations

import collections
from typing import Callable, NamedTuple, Sequence

from .checks import warn_user

__all__ = ["TRANSPORTS", "Transport", "choose_transport", "transport_for"]

TRANSPORTS = ("auto", "nccl", "gloo", "staged")


class Transport(NamedTuple):
    backend: str  # "nccl" | "gloo"
    staged: bool  # tensors travel through host memory (Note [staged transport])
    reason: str


def choose_transport(requested: str, device: str, slots: Sequence[tuple]) -> Transport:
    """``slots[i]``: actor i's ``(node, GPU ids)`` (``StageWorker.gpu_slot``)."""
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
