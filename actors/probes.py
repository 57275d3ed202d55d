"""``Probes``: what an actor answers about itself, for placement, the transport's choice,
the profiler and PipeFill: who and where it is (process, node, GPUs, a free port), its
clock, its memory, and the links to its peers.  Also this process's resident-memory helpers
(the reuse of a process and the memory benches read them)."""

from __future__ import annotations

import ctypes
import os

import torch

from .comm import Communicator, free_address
from .place import ActorPlace
from .stages import Stages
from .tensor_parallel import local
from .timing import DeviceTimer

__all__ = ["Probes", "peak_rss_bytes", "reset_peak_rss", "trim_heap", "rss_bytes"]


class Probes:
    def __init__(self, place: ActorPlace, timer: DeviceTimer) -> None:
        self.place, self.timer = place, timer

    # -- identity ------------------------------------------------------------------------------
    @staticmethod
    def address() -> tuple[str, int]:
        """A free port on this node for the process groups' rendezvous."""
        return free_address()

    @staticmethod
    def node_id() -> str:
        """The Ray node this actor runs on (placement checks)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    @staticmethod
    def gpu_slot() -> tuple[str, tuple]:
        """(node, the GPUs Ray gave this actor): actors with a GPU in common cannot use NCCL
        (Note [staged transport] in actors/comm.py)."""
        import ray

        return ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids())

    # -- profiling -----------------------------------------------------------------------------
    def probe_links(self, comm: Communicator, pairs: list, sizes: list, repeats: int) -> list:
        """Ping-pong messages of each size with the other actor of each pair ``(a, b)`` (global
        ranks) this actor belongs to; ``[(a, b, bytes, one-way seconds)]`` measured on ``a``.
        Every actor walks the pairs in the same order, so each exchange has both ends there
        (the argument of Note [tie reduction] in schedules/passes.py).  Run between steps."""
        me, out = self.place.global_rank, []
        for a, b in pairs:
            if me not in (a, b):
                continue
            peer = b if me == a else a
            for n in sizes:
                metas = [((max(1, n // 4),), "float32")]
                x = torch.zeros(max(1, n // 4), device=self.place.device)
                for _ in range(repeats + 1):  # the first exchange of a size warms buffers: not kept
                    t0 = self.timer.seconds()  # Note [device timing]: NCCL's recv returns before the data
                    if me == a:
                        comm.send([x], peer)
                        comm.recv(metas, peer)
                    else:
                        comm.recv(metas, peer)
                        comm.send([x], peer)
                    comm.flush()
                    out.append((a, b, n, (self.timer.seconds() - t0) / 2))
                del out[-repeats - 1]
        return [o for o in out if me == o[0]]

    # -- memory --------------------------------------------------------------------------------
    def free_memory_bytes(self) -> int:
        """Memory a fill job may use here: free device memory, or available RAM on CPU."""
        device = self.place.device
        if device.type == "cuda":  # within this actor's share of a shared GPU (limit_memory)
            free, total = torch.cuda.mem_get_info(device)
            return int(max(0, min(free, self.place.memory_fraction * total - torch.cuda.memory_reserved(device))))
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    @staticmethod
    def memory_bytes(stages: Stages) -> dict:
        """Bytes this actor holds for training: ``params`` (its stages' parameters), ``grads``
        (the gradients it keeps past the data-parallel reduction: all, or under ZeRO-1 the ones it
        owns and those a tie needs whole) and ``optimizer`` (every tensor of its optimizers' state)."""
        params = [p for m in stages.modules.values() for p in m.parameters()]
        zero = stages.zero
        kept = [p for p in params if p.requires_grad] if not zero else [
            p for zs in zero.values() for p in zs.params if p.requires_grad and (zs.owns(p) or id(p) in zs.tied)]
        state = [t for opt in stages.optimizers.values() for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        return {name: sum(local(t).numel() * t.element_size() for t in ts)  # this actor's part under TP
                for name, ts in (("params", params), ("grads", kept), ("optimizer", state))}

    def memory_stats(self, stages: Stages, reset: bool = False) -> dict:
        """Peak resident memory of this process and, on CUDA, peak allocated device memory
        (bytes), the current resident size (``rss_bytes``), and ``memory_bytes`` (``params_bytes``,
        ...); ``reset`` starts new peaks (resident and device) after reading."""
        device = self.place.device
        peak = peak_rss_bytes()
        if reset:
            trim_heap()  # the resident size below is what the process holds
        stats = {"peak_rss_bytes": peak, "rss_bytes": rss_bytes(),
                 "device_peak_bytes": 0, **{f"{k}_bytes": v for k, v in self.memory_bytes(stages).items()}}
        if device.type == "cuda":
            stats["device_peak_bytes"] = torch.cuda.max_memory_allocated(device)
            if reset:
                torch.cuda.reset_peak_memory_stats(device)
        if reset:
            reset_peak_rss()
        return stats


def rss_bytes() -> int:
    """This process's current resident memory (the soak test watches it)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's peak resident memory since it started or since ``reset_peak_rss``: the
    kernel's VmHWM (Linux), else ``ru_maxrss`` (which cannot be reset)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def trim_heap() -> None:
    """Hand the heap's free memory back to the kernel (glibc's ``malloc_trim``; elsewhere
    nothing), so that resident sizes measured next count what the process holds."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def reset_peak_rss() -> None:
    """Start a new VmHWM from the current resident size (Linux: ``/proc/self/clear_refs``),
    after ``trim_heap``, so that a peak measured from here counts what the process allocates,
    not free pages it happened to keep."""
    trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
