"""``StageWorker``: what one pipeline rank runs inside its Ray actor.

The worker is the actor's face: each remote method hands the call to the component that
owns the state it concerns, each a plain object made here:

* ``Interpreter`` (actors/interpreter.py) runs the compiled programs, step by step
  (``run_call``), over ``Transfers`` (actors/transfers.py: sends, receives, shapes learned);
* ``Stages`` (actors/stages.py): the modules, optimizers and what trains them, made by
  ``setup`` from a ``StageSetup`` (actors/protocol.py);
* ``StateStore`` (actors/store.py): state dicts, checkpoint shards, export, RNG;
* ``Probes`` (actors/probes.py): identity, clock, memory, links;
* ``FillRunner`` (actors/fill.py): PipeFill's jobs and their outputs.

The communicator comes with ``init_comm`` (a ``CommSetup``), and the ``Transfers`` and the
``Interpreter`` that use it with it.  A process kept for the next pipeline (``park``,
``rebind``; Note [reused actors] in mpmd/runtime/pool.py) gets new components, as a new
process would.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from typing import Optional

import torch

from schedules import PREFETCH

from .channel import ChannelServer
from .comm import Communicator, node_ip
from .fill import FillRunner
from .grid import DeviceGrid
from .interpreter import Interpreter
from .place import ActorPlace, actor_gpu, limit_memory
from .probes import Probes, reset_peak_rss, rss_bytes
from .process import CHANNEL_METHODS, bypass_ray_wrappers, match_niceness, serialize_calls
from .protocol import CommSetup, StageSetup
from .stages import Stages, build_stages
from .store import StateStore
from .timing import device_timer
from .transfers import Transfers

__all__ = ["StageWorker"]


class StageWorker:
    PREFETCH = PREFETCH  # receives posted ahead (Note [receive prefetch] in actors/transfers.py)

    def __init__(self, *, rank: int, replica: int, num_ranks: int, device: str, seed: int = 0,
                 niceness: Optional[int] = None, memory_fraction: float = 1.0, dp: int = 1, tp: int = 1,
                 tp_rank: int = 0, ep: int = 1, cp: int = 1, cp_rank: int = 0) -> None:
        self.niceness = match_niceness(niceness)
        self.call_lock = threading.RLock()  # Note [step channel] in actors/channel.py
        self._channel: Optional[ChannelServer] = None
        grid = DeviceGrid(dp=dp, pp=num_ranks, tp=tp, ep=ep, cp=cp)  # Note [device grid] in actors/grid.py
        here = torch.device("cpu") if device != "cuda" else torch.device("cuda", actor_gpu())
        self.place = ActorPlace(rank=rank, replica=replica, tp_rank=tp_rank, cp_rank=cp_rank, grid=grid,
                                global_rank=grid.actor(replica, rank, tp_rank, cp_rank), device=here,
                                memory_fraction=limit_memory(here, memory_fraction))  # a shared GPU's share
        torch.manual_seed(seed)
        self.timer = device_timer(here)  # Note [device timing] in actors/timing.py
        self.fill = FillRunner()  # chunks on a stream of their own (Note [device timing])
        self.probes = Probes(self.place, self.timer)
        self.store = StateStore(self.place)
        self.stages = Stages()  # until ``setup``
        self.comm: Optional[Communicator] = None  # from ``init_comm``, with the two below
        self.transfers: Optional[Transfers] = None
        self.interpreter: Optional[Interpreter] = None
        bypass_ray_wrappers(self)  # Note [Ray's method wrappers] in actors/process.py

    # -- set-up (once) -------------------------------------------------------------------------
    def open_channel(self, key: bytes, controller_ip: str) -> tuple[str, int]:
        """Listen for the controller's step channel, keyed (Note [step channel]); its address."""
        here = node_ip()  # loopback when the controller is on this node
        self._channel = ChannelServer(self._channel_call, "127.0.0.1" if here == controller_ip else here, key)
        return self._channel.address

    def _channel_call(self, method: str, args: tuple):
        if method not in CHANNEL_METHODS:
            raise RuntimeError(f"{method!r} cannot be called over the step channel")
        return getattr(self, method)(*args)

    def init_comm(self, setup: CommSetup) -> None:
        self.comm = comm = Communicator(
            world_size=setup.world_size, rank=self.place.global_rank, address=tuple(setup.address),
            backend=setup.backend, timeout_s=setup.timeout_s, dp_groups=setup.dp_groups, device=self.place.device,
            tie_groups=setup.tie_groups, staged=setup.staged, queued=setup.queued,
            tp_groups=self.place.grid.tp_groups(), p2p_groups=setup.p2p_groups, ep_groups=setup.ep_groups,
            edp_groups=setup.edp_groups, cp_groups=self.place.grid.cp_groups())
        self.transfers = Transfers(comm, self.place)  # shapes learned, receives posted early
        self.interpreter = Interpreter(self.place, comm, self.timer, self.transfers, self.fill)

    def setup(self, setup: StageSetup) -> None:
        """Build the stages ``setup`` describes and train them from the next step."""
        self.stages.disarm()  # the last setup's reductions (``reschedule``)
        self.stages = build_stages(setup, self.place, self.comm)
        self.interpreter.use_stages(self.stages)

    def set_program(self, name: str, data: bytes) -> int:
        return self.interpreter.set_program(name, data)

    def attach_feed(self, feed) -> None:
        """Fed steps' batches (Note [fed steps] in actors/feed.py): ``Interpreter.attach_feed``."""
        self.interpreter.attach_feed(feed)

    def tie_layouts(self) -> dict:
        return self.stages.tie_layouts()

    def register_fill_job(self, job_id: int, fn, collate: bool, data) -> None:
        self.fill.register(job_id, fn, collate, data)

    def drop_fill_jobs(self, job_ids: list) -> None:
        self.fill.drop(job_ids)

    def take_fill_outputs(self) -> dict:
        return self.fill.take_outputs()

    # -- one step ----------------------------------------------------------------------------
    def run_call(self, call: tuple, inputs=None, targets=None, fills: Optional[dict] = None,
                 side: Optional[tuple] = None) -> Optional[tuple]:
        """Run instructions ``[call.start, call.end)`` of program ``call.program`` for ``call.step``.

        ``call`` is a ``StepCall`` as a plain tuple, and the ``StepReply`` goes back as one
        (Note [plain tuples on the wire] in ``actors/protocol.py``).  ``call.start == 0``
        begins the step: ``inputs`` for the first stage, ``targets`` for the last,
        ``fills`` assigns PipeFill chunks to this step's ``FILL`` slots (``{slot:
        FillSlot}``), ``side`` holds the step's side inputs for the local stages
        (``(per microbatch, whole)``).  ``call.last`` ends it and returns the reply.  The
        arguments are positional: Ray checks and flattens each keyword argument of every call."""
        return self.interpreter.run_call(call, inputs, targets, fills, side)

    # -- probes (actors/probes.py) -------------------------------------------------------------
    def address(self) -> tuple[str, int]:
        return self.probes.address()

    def pid(self) -> int:
        return os.getpid()

    def node_id(self) -> str:
        return self.probes.node_id()

    def gpu_slot(self) -> tuple[str, tuple]:
        return self.probes.gpu_slot()

    def clock_ns(self) -> int:
        """This actor's ``time.time_ns()``: the profiler estimates clock offsets from it."""
        return time.time_ns()

    def sent_bytes(self, program: str) -> dict[int, int]:
        return self.transfers.sent_bytes(program)

    def probe_links(self, pairs: list, sizes: list, repeats: int) -> list:
        return self.probes.probe_links(self.comm, pairs, sizes, repeats)

    def free_memory_bytes(self) -> int:
        return self.probes.free_memory_bytes()

    def memory_bytes(self) -> dict:
        return self.probes.memory_bytes(self.stages)

    def memory_stats(self, reset: bool = False) -> dict:
        return self.probes.memory_stats(self.stages, reset)

    def rss_bytes(self) -> int:
        return rss_bytes()

    # -- state (actors/store.py) ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return self.store.state_dict(self.stages)

    def state_shapes(self) -> dict:
        return self.store.state_shapes(self.stages)

    def export_stage(self, path: str, names: dict, dtype: Optional[str] = None, experts: Optional[dict] = None) -> dict:
        return self.store.export_stage(self.stages, path, names, dtype, experts)

    def expert_slices(self, names: dict) -> dict:
        return self.store.expert_slices(self.stages, names)

    def import_stage(self, directory: str, names: dict, weight_map: dict) -> None:
        self.store.import_stage(self.stages, directory, names, weight_map)

    def load_state_dict(self, stages: list, *states: dict) -> None:
        self.store.load_state_dict(self.stages, stages, states)

    def optimizer_state(self) -> bytes:
        return self.store.optimizer_state(self.stages)

    def checkpoint_state(self, snapshot: bool = False) -> dict:
        return self.store.checkpoint_state(self.stages, snapshot)

    def optimizer_shards(self, snapshot: bool = False) -> dict:
        return self.store.optimizer_shards(self.stages, snapshot)

    def save_shard(self, directory: str, blocking: bool = True) -> tuple:
        return self.store.save_shard(self.stages, directory, blocking)

    def shard_status(self) -> tuple:
        return self.store.shard_status()

    def read_shard(self, directory: str, rng: bool) -> tuple:
        return self.store.read_shard(self.stages, directory, rng)

    def apply_shard(self, apply: bool = True) -> None:
        self.store.apply_shard(self.stages, apply)

    def load_checkpoint_state(self, states: dict) -> None:
        self.store.load_checkpoint_state(self.stages, states)

    def rng_state(self) -> dict:
        return self.store.rng_state()

    def set_rng_state(self, state: dict) -> None:
        self.store.set_rng_state(state)

    # -- the end, or the next pipeline (Note [reused actors] in mpmd/runtime/pool.py) -----------
    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self.comm is not None:
            self.comm.close()
            self.comm = None

    def park(self) -> int:
        """Finish what this pipeline left running here (an asynchronous checkpoint write, a Ray
        Data feed, the step channel, the process groups), drop its modules, optimizers,
        programs and buffers, and wait for ``rebind``; the process id."""
        self.store.join_writer()  # a write in flight finishes (or fails) first
        if self.interpreter is not None:
            self.interpreter.close()  # the feed closes, and the overlaps' thread ends
        self.shutdown()  # the step channel, and the process groups destroyed
        torch.compiler.reset()  # graphs compiled for this pipeline's modules (mpmd train's compile=true)
        torch.set_grad_enabled(True)
        self.stages.disarm()
        self.stages, self.transfers, self.interpreter, self._channel = Stages(), None, None, None
        self.fill, self.store = FillRunner(), StateStore(self.place)
        gc.collect()
        return os.getpid()

    def rebind(self, **kwargs) -> int:
        """Become the actor ``StageWorker(**kwargs)`` would be: the constructor runs again and
        makes new components (the seed, the niceness, the grid place); the process id."""
        reset_peak_rss()  # memory_stats's peak is this pipeline's, as in a fresh process
        self.__init__(**kwargs)
        return os.getpid()


serialize_calls(StageWorker)
