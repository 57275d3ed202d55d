"""What a ``StageWorker`` answers besides running programs: its state for
``state_dict`` and checkpoints (modules, optimizers, RNG), and the probes the profiler
and PipeFill read (clock, memory).  Mixed into ``actors.worker.StageWorker``, which owns
``self.modules``, ``self.optimizers`` and ``self.device``.  The checkpoint files themselves are
written and read in ``actors/checkpoint_io.py``."""

from __future__ import annotations

import copy
import ctypes
import dataclasses
import io
import math
import os
import time
from typing import Any, Optional

import torch

from .checkpoint_io import DONE, ShardReport, ShardWriter, Where, copy_state, describe, shapes_of, write_shard
from .checkpoint_io import read_shard as read_files
from .hf_io import read_safetensors, write_safetensors
from .comm import free_address
from .pieces import part_of, to_pieces
from .tensor_parallel import local, local_optimizer_state, local_state, whole
from .zero import merge_named, named_state, positional_state

__all__ = ["WorkerState", "limit_memory", "peak_rss_bytes", "reset_peak_rss", "trim_heap", "cuda_index", "actor_gpu"]


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


class WorkerState:
    modules: dict
    optimizers: dict
    schedulers: dict
    loss_scale: Any  # actors.update.LossScale, or None
    device: torch.device
    rank: int
    replica: int
    global_rank: int  # the actor's index in the controller's list (replica-major)
    timer: Any  # actors.timing.DeviceTimer
    memory_fraction: float  # of its GPU this actor's allocator may use (limit_memory)
    _sent_meta: dict  # (program, stage) -> (spec, metas) of the stage's output as sent
    _writer: Optional[ShardWriter] = None  # the last asynchronous shard write
    _staged: Optional[tuple] = None  # a shard read_shard read, for apply_shard

    def address(self) -> tuple[str, int]:
        """A free port on this node for the process groups' rendezvous."""
        return free_address()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        """The Ray node this actor runs on (placement checks)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def gpu_slot(self) -> tuple[str, tuple]:
        """(node, the GPUs Ray gave this actor): actors with a GPU in common cannot use NCCL
        (Note [staged transport] in actors/comm.py)."""
        import ray

        return ray.get_runtime_context().get_node_id(), tuple(str(g) for g in ray.get_gpu_ids())

    # -- profiling probes ----------------------------------------------------------------------
    def clock_ns(self) -> int:
        """This actor's ``time.time_ns()``: the profiler estimates clock offsets from it."""
        return time.time_ns()

    def sent_bytes(self, program: str) -> dict[int, int]:
        """Bytes of each local stage's output as program ``program`` last sent it (stage ->
        bytes; its gradient coming back is as large): the calibrated transfers' sizes."""
        return {stage: sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in metas)
                for (prog, stage), (_, metas) in self._sent_meta.items() if prog == program}

    def probe_links(self, pairs: list, sizes: list, repeats: int) -> list:
        """Ping-pong messages of each size with the other actor of each pair ``(a, b)`` (global
        ranks) this actor belongs to; ``[(a, b, bytes, one-way seconds)]`` measured on ``a``.
        Every actor walks the pairs in the same order, so each exchange has both ends there
        (the argument of Note [tie reduction] in schedules/passes.py).  Run between steps."""
        out = []
        for a, b in pairs:
            if self.global_rank not in (a, b):
                continue
            peer = b if self.global_rank == a else a
            for n in sizes:
                metas = [((max(1, n // 4),), "float32")]
                x = torch.zeros(max(1, n // 4), device=self.device)
                for _ in range(repeats + 1):  # the first exchange of a size warms buffers: not kept
                    t0 = self.timer.seconds()  # Note [device timing]: NCCL's recv returns before the data
                    if self.global_rank == a:
                        self.comm.send([x], peer)
                        self.comm.recv(metas, peer)
                    else:
                        self.comm.recv(metas, peer)
                        self.comm.send([x], peer)
                    self.comm.flush()
                    out.append((a, b, n, (self.timer.seconds() - t0) / 2))
                del out[-repeats - 1]
        return [o for o in out if self.global_rank == o[0]]

    def free_memory_bytes(self) -> int:
        """Memory a fill job may use here: free device memory, or available RAM on CPU."""
        if self.device.type == "cuda":  # within this actor's share of a shared GPU (limit_memory)
            free, total = torch.cuda.mem_get_info(self.device)
            return int(max(0, min(free, self.memory_fraction * total - torch.cuda.memory_reserved(self.device))))
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    def memory_bytes(self) -> dict:
        """Bytes this actor holds for training: ``params`` (its stages' parameters), ``grads``
        (the gradients it keeps past the data-parallel reduction: all, or under ZeRO-1 the ones it
        owns and those a tie needs whole) and ``optimizer`` (every tensor of its optimizers' state)."""
        params = [p for m in self.modules.values() for p in m.parameters()]
        zero = getattr(self, "zero", {})
        kept = [p for p in params if p.requires_grad] if not zero else [
            p for zs in zero.values() for p in zs.params if p.requires_grad and (zs.owns(p) or id(p) in zs.tied)]
        state = [t for opt in self.optimizers.values() for st in opt.state.values() for t in st.values()
                 if isinstance(t, torch.Tensor)]
        return {name: sum(local(t).numel() * t.element_size() for t in ts)  # this actor's part under TP
                for name, ts in (("params", params), ("grads", kept), ("optimizer", state))}

    def memory_stats(self, reset: bool = False) -> dict:
        """Peak resident memory of this process and, on CUDA, peak allocated device memory
        (bytes), the current resident size (``rss_bytes``), and ``memory_bytes`` (``params_bytes``,
        ...); ``reset`` starts new peaks (resident and device) after reading."""
        peak = peak_rss_bytes()
        if reset:
            trim_heap()  # the resident size below is what the process holds
        stats = {"peak_rss_bytes": peak, "rss_bytes": self.rss_bytes(),
                 "device_peak_bytes": 0, **{f"{k}_bytes": v for k, v in self.memory_bytes().items()}}
        if self.device.type == "cuda":
            stats["device_peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            if reset:
                torch.cuda.reset_peak_memory_stats(self.device)
        if reset:
            reset_peak_rss()
        return stats

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Whole tensors on the CPU.  Under TP every TP rank calls this together (each tensor is
        gathered over the TP group, one at a time) and only TP rank 0 keeps and returns them:
        the others answer ``{}``, so the controller receives each stage once."""
        keep = not getattr(self, "tp_rank", 0)
        out = {}
        for s, m in sorted(self.modules.items()):
            state = {}
            for k, v in m.state_dict().items():
                v = whole(v).detach()  # a collective for a DTensor: every TP rank, same order
                if keep:
                    state[k] = v.cpu()
            if keep:
                out[s] = state
        return out

    def state_shapes(self) -> dict:
        """``{stage: {key: whole shape}}``: what ``load_state_dict`` must be given (no communication)."""
        return {s: {k: tuple(v.shape) for k, v in m.state_dict().items()} for s, m in sorted(self.modules.items())}

    def export_stage(self, path: str, names: dict, dtype: Optional[str] = None) -> dict:
        """Write this actor's part of a Hugging Face export to ``path`` (every TP rank of a stage
        together: ``write_safetensors``); ``{exported key: bytes}``."""
        return write_safetensors(path, self.modules, names, getattr(self, "tp_rank", 0), self.grid.tp,
                                 getattr(torch, dtype) if dtype else None)

    def import_stage(self, directory: str, names: dict, weight_map: dict) -> None:
        """Copy this actor's part of a model's safetensors files into its stages (``read_safetensors``)."""
        read_safetensors(directory, self.modules, names, weight_map)

    def load_state_dict(self, stages: list, *states: dict) -> None:
        """Load ``states[i]`` (whole tensors, this actor keeping its part) into stage ``stages[i]``."""
        for s, sd in zip(stages, states, strict=True):
            self.modules[int(s)].load_state_dict(local_state(self.modules[int(s)], sd))

    def optimizer_state(self) -> bytes:
        buf = io.BytesIO()
        torch.save({s: opt.state_dict() for s, opt in self.optimizers.items()}, buf)
        return buf.getvalue()

    # -- checkpoints (Note [sharded checkpoint] in mpmd/training/checkpoint.py) -------------------
    def checkpoint_state(self, snapshot: bool = False) -> dict:
        """Per stage: module, optimizer and LR scheduler state, on the CPU; and fp16's loss
        scale (the same on every actor).  ``snapshot``: copies that later steps leave alone."""
        out = {}
        for s, m in self.modules.items():
            opt, sched = self.optimizers.get(s), self.schedulers.get(s)
            sched_state = sched.state_dict() if sched is not None else None
            zero = s in getattr(self, "zero", {})  # its optimizer state is in the replicas' shard files
            out[s] = {"module": copy_state(to_pieces(m.state_dict()), snapshot),  # Note [checkpoint pieces]
                      "optimizer": copy_state(to_pieces(opt.state_dict()), snapshot) if opt is not None and not zero
                      else None,
                      "scheduler": copy.deepcopy(sched_state) if snapshot else sched_state,
                      "loss_scale": dataclasses.asdict(self.loss_scale) if self.loss_scale is not None else None}
            if zero and opt is not None:
                out[s]["optimizer_shards"] = self.dp
            if self.grid.tp > 1:
                out[s]["tp_parts"] = self.grid.tp
        return out

    def optimizer_shards(self, snapshot: bool = False) -> dict:
        """Under ZeRO-1, per stage, this replica's shard of its optimizer state by parameter name."""
        zero = getattr(self, "zero", {})
        return {s: copy_state(named_state(to_pieces(opt.state_dict()), _order(opt, zero[s].names)), snapshot)
                for s, opt in sorted(self.optimizers.items()) if s in zero}

    def save_shard(self, directory: str, blocking: bool = True) -> tuple:
        """Write this actor's shard of a checkpoint into ``directory``: its stages' files (on the
        first replica only: the replicas hold the same state) and its RNG state.  ``blocking``:
        written before this returns.  Otherwise the state is copied now (under the lock, after
        the steps before this call) and a thread writes it while steps go on, leaving a marker.
        A ``ShardReport`` as a tuple; a failure is in it, not raised."""
        self._join_writer()
        where = Where(self.global_rank, self.rank, self.replica)
        try:
            states = self.checkpoint_state(snapshot=not blocking) if self.replica == 0 else {}
            shards = self.optimizer_shards(snapshot=not blocking)  # ZeRO-1: every replica writes its own
            tp_rank = getattr(self, "tp_rank", 0)
            shapes = shapes_of(states) if not tp_rank else {}
            if tp_rank:  # Note [checkpoint pieces]: its pieces; TP rank 0 writes the replicated values
                states, shards = part_of(states), part_of(shards)
            rng = self.rng_state()
        except Exception as e:  # noqa: BLE001 - the save fails, the pipeline does not
            return tuple(ShardReport(where.index, {}, f"{where} could not take its state: {describe(e)}"))
        if blocking:
            error, nbytes = write_shard(directory, where, states, rng, shards, tp_rank)
            return tuple(ShardReport(where.index, shapes, error, nbytes))
        self._writer = ShardWriter(directory, where, states, rng, shards, tp_rank)
        return tuple(ShardReport(where.index, shapes))

    def shard_status(self) -> tuple:
        """``(status, error)`` of the last asynchronous shard write (``WRITING``, ``DONE``, ``FAILED``)."""
        writer = self._writer
        return (DONE, None) if writer is None else (writer.status, writer.error)

    def _join_writer(self) -> None:
        if self._writer is not None:
            self._writer.join()

    def read_shard(self, directory: str, rng: bool) -> tuple:
        """Read the files of this actor's stages (and, ``rng``, of its RNG state) from the
        checkpoint ``directory`` and hold them for ``apply_shard``; the report has the shapes
        read, for the controller to check, or the error."""
        where = Where(self.global_rank, self.rank, self.replica)
        self._staged = None
        error, states, rng_state = read_files(directory, where, sorted(self.modules), rng)
        if error is None:
            self._staged = (states, rng_state)
        return tuple(ShardReport(where.index, shapes_of(states), error))

    def apply_shard(self, apply: bool = True) -> None:
        """Load what ``read_shard`` read (``apply``), or drop it."""
        staged, self._staged = self._staged, None
        if not apply:
            return
        if staged is None:
            raise RuntimeError("apply_shard without a successful read_shard")
        states, rng = staged
        self.load_checkpoint_state(states)
        if rng is not None:
            self.set_rng_state(rng)

    def load_checkpoint_state(self, states: dict) -> None:
        for s, state in states.items():
            self.modules[int(s)].load_state_dict(local_state(self.modules[int(s)], state["module"]))
            opt, sched = self.optimizers.get(int(s)), self.schedulers.get(int(s))
            if opt is not None:
                self._load_optimizer(int(s), opt, state)
            if sched is not None and state.get("scheduler") is not None:
                sched.load_state_dict(state["scheduler"])
            if self.loss_scale is not None and state.get("loss_scale"):
                for name, value in state["loss_scale"].items():
                    setattr(self.loss_scale, name, value)

    def _load_optimizer(self, s: int, opt, state: dict) -> None:
        """Stage ``s``'s optimizer state from a checkpoint written under any dp and zero (Note
        [ZeRO-1 sharding]): by parameter name, unless both sides hold it whole."""
        zero = getattr(self, "zero", {}).get(s)
        named = merge_named(state["optimizer_named"]) if state.get("optimizer_named") else None
        params = [p for g in opt.param_groups for p in g["params"]]  # whole tensors cut to this actor's part
        if named is None and state.get("optimizer") is not None:
            if zero is None:
                opt.load_state_dict(local_optimizer_state(state["optimizer"], params))
                return
            named = named_state(state["optimizer"], zero.full_order)
        if named is not None:
            names = zero.names if zero is not None else {id(p): n for n, p in self.modules[s].named_parameters()}
            opt.load_state_dict(local_optimizer_state(positional_state(named, _order(opt, names)), params))

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



def _order(opt, names: dict) -> list[list[str]]:
    """The names of ``opt``'s parameters per group, as it holds them."""
    return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
