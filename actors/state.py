"""What a ``StageWorker`` answers besides running programs: its state for
``state_dict`` and checkpoints (modules, optimizers, RNG), and the probes the profiler
and PipeFill read (clock, memory).  Mixed into ``actors.worker.StageWorker``, which owns
``self.modules``, ``self.optimizers`` and ``self.device``."""

from __future__ import annotations

import dataclasses
import io
import os
import time
from typing import Any

import torch

__all__ = ["WorkerState"]


class WorkerState:
    modules: dict
    optimizers: dict
    schedulers: dict
    loss_scale: Any  # actors.update.LossScale, or None
    device: torch.device

    # -- profiling probes ----------------------------------------------------------------------
    def clock_ns(self) -> int:
        """This actor's ``time.time_ns()``: the profiler estimates clock offsets from it."""
        return time.time_ns()

    def free_memory_bytes(self) -> int:
        """Memory a fill job may use here: free device memory, or available RAM on CPU."""
        if self.device.type == "cuda":
            return int(torch.cuda.mem_get_info(self.device)[0])
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    def memory_stats(self, reset: bool = False) -> dict:
        """Peak resident memory of this process and, on CUDA, peak allocated device memory
        (bytes); ``reset`` starts a new device peak after reading."""
        import resource

        stats = {"peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                 "device_peak_bytes": 0}
        if self.device.type == "cuda":
            stats["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.device)
        return stats

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {s: {k: v.detach().cpu() for k, v in m.state_dict().items()} for s, m in self.modules.items()}

    def load_state_dict(self, states: dict) -> None:
        for s, sd in states.items():
            self.modules[int(s)].load_state_dict(sd)

    def optimizer_state(self) -> bytes:
        buf = io.BytesIO()
        torch.save({s: opt.state_dict() for s, opt in self.optimizers.items()}, buf)
        return buf.getvalue()

    # -- checkpoints (mpmd/checkpoint.py) ----------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """Per stage: module, optimizer and LR scheduler state, on the CPU; and fp16's loss
        scale (the same on every actor)."""
        out = {}
        for s, m in self.modules.items():
            opt, sched = self.optimizers.get(s), self.schedulers.get(s)
            out[s] = {"module": {k: v.detach().cpu() for k, v in m.state_dict().items()},
                      "optimizer": _to_cpu(opt.state_dict()) if opt is not None else None,
                      "scheduler": sched.state_dict() if sched is not None else None,
                      "loss_scale": dataclasses.asdict(self.loss_scale) if self.loss_scale is not None else None}
        return out

    def load_checkpoint_state(self, states: dict) -> None:
        for s, state in states.items():
            self.modules[int(s)].load_state_dict(state["module"])
            opt, sched = self.optimizers.get(int(s)), self.schedulers.get(int(s))
            if opt is not None and state.get("optimizer") is not None:
                opt.load_state_dict(state["optimizer"])
            if sched is not None and state.get("scheduler") is not None:
                sched.load_state_dict(state["scheduler"])
            if self.loss_scale is not None and state.get("loss_scale"):
                for name, value in state["loss_scale"].items():
                    setattr(self.loss_scale, name, value)

    def rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if self.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)

    def rss_bytes(self) -> int:
        """This actor process's current resident memory (the soak test watches it)."""
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value
