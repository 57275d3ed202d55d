"""What tests that start their own gloo processes (no Ray) share."""

from __future__ import annotations

import os
import socket
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the processes' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(fn: Callable[..., Any], size: int, *args: Any, threads: Optional[int] = None) -> dict[int, Any]:
    """``fn(rank, group, *args)`` in ``size`` new processes joined in one gloo group (``group``:
    all of them), ``torch.set_num_threads(threads)`` first when given; what each returned, by
    rank.  ``fn`` and ``args`` must pickle (a module-level function)."""
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_rank, args=(size, free_port(), threads, fn, args, out), nprocs=size, join=True)
        return dict(out)


def _rank(rank: int, size: int, port: int, threads: Optional[int], fn: Callable, args: tuple, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if threads is not None:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", rank=rank, world_size=size)
    try:
        out[rank] = fn(rank, dist.new_group(list(range(size))), *args)
    finally:
        dist.destroy_process_group()
