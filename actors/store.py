"""``StateStore``: an actor's state as the controller reads and writes it, for ``state_dict``
and checkpoints (modules, optimizers, LR schedulers, fp16's loss scale, RNG) and Hugging
Face export and import.  It owns what outlives one call, the asynchronous shard write in
flight and a shard read for ``apply_shard``; the stages it reads are given with each call
(the ``Stages`` of the last ``setup``, actors/stages.py).  The checkpoint files themselves
are written and read in ``actors/checkpoint_io.py``."""

from __future__ import annotations

import copy
import dataclasses
import io
from typing import Optional

import torch

from .checkpoint_io import DONE, ShardReport, ShardWriter, Where, copy_state, describe, shapes_of, write_shard
from .checkpoint_io import read_shard as read_files
from .hf_io import read_safetensors, write_safetensors
from .pieces import part_of, to_pieces
from .place import ActorPlace
from .stages import Stages
from .tensor_parallel import local_optimizer_state, local_state, whole
from .zero import merge_named, named_state, positional_state

__all__ = ["StateStore"]


class StateStore:
    def __init__(self, place: ActorPlace) -> None:
        self.place = place
        self._writer: Optional[ShardWriter] = None  # the last asynchronous shard write
        self._staged: Optional[tuple] = None  # a shard read_shard read, for apply_shard

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self, stages: Stages) -> dict:
        """Whole tensors on the CPU.  Under TP every TP rank calls this together (each tensor is
        gathered over the TP group, one at a time) and only TP rank 0 keeps and returns them:
        the others answer ``{}``, so the controller receives each stage once."""
        keep = not self.place.tp_rank
        out = {}
        for s, m in sorted(stages.modules.items()):
            state = {}
            for k, v in m.state_dict().items():
                v = whole(v).detach()  # a collective for a DTensor: every TP rank, same order
                if keep:
                    state[k] = v.cpu()
            if keep:
                out[s] = state
        return out

    @staticmethod
    def state_shapes(stages: Stages) -> dict:
        """``{stage: {key: whole shape}}``: what ``load_state_dict`` must be given (no communication)."""
        return {s: {k: tuple(v.shape) for k, v in m.state_dict().items()} for s, m in sorted(stages.modules.items())}

    def export_stage(self, stages: Stages, path: str, names: dict, dtype: Optional[str] = None) -> dict:
        """Write this actor's part of a Hugging Face export to ``path`` (every TP rank of a stage
        together: ``write_safetensors``); ``{exported key: bytes}``."""
        return write_safetensors(path, stages.modules, names, self.place.tp_rank, self.place.grid.tp,
                                 getattr(torch, dtype) if dtype else None)

    @staticmethod
    def import_stage(stages: Stages, directory: str, names: dict, weight_map: dict) -> None:
        """Copy this actor's part of a model's safetensors files into its stages (``read_safetensors``)."""
        read_safetensors(directory, stages.modules, names, weight_map)

    @staticmethod
    def load_state_dict(stages: Stages, numbers: list, states: tuple) -> None:
        """Load ``states[i]`` (whole tensors, this actor keeping its part) into stage ``numbers[i]``."""
        for s, sd in zip(numbers, states, strict=True):
            stages.modules[int(s)].load_state_dict(local_state(stages.modules[int(s)], sd))

    @staticmethod
    def optimizer_state(stages: Stages) -> bytes:
        buf = io.BytesIO()
        torch.save({s: opt.state_dict() for s, opt in stages.optimizers.items()}, buf)
        return buf.getvalue()

    # -- checkpoints (Note [sharded checkpoint] in mpmd/training/checkpoint.py) -------------------
    def checkpoint_state(self, stages: Stages, snapshot: bool = False) -> dict:
        """Per stage: module, optimizer and LR scheduler state, on the CPU; and fp16's loss
        scale (the same on every actor).  ``snapshot``: copies that later steps leave alone."""
        out = {}
        for s, m in stages.modules.items():
            opt, sched = stages.optimizers.get(s), stages.schedulers.get(s)
            sched_state = sched.state_dict() if sched is not None else None
            zero = s in stages.zero  # its optimizer state is in the replicas' shard files
            out[s] = {"module": copy_state(to_pieces(m.state_dict()), snapshot),  # Note [checkpoint pieces]
                      "optimizer": copy_state(to_pieces(opt.state_dict()), snapshot) if opt is not None and not zero
                      else None,
                      "scheduler": copy.deepcopy(sched_state) if snapshot else sched_state,
                      "loss_scale": dataclasses.asdict(stages.loss_scale) if stages.loss_scale is not None else None}
            if zero and opt is not None:
                out[s]["optimizer_shards"] = stages.dp
            if self.place.grid.tp > 1:
                out[s]["tp_parts"] = self.place.grid.tp
        return out

    @staticmethod
    def optimizer_shards(stages: Stages, snapshot: bool = False) -> dict:
        """Under ZeRO-1, per stage, this replica's shard of its optimizer state by parameter name."""
        zero = stages.zero
        return {s: copy_state(named_state(to_pieces(opt.state_dict()), _order(opt, zero[s].names)), snapshot)
                for s, opt in sorted(stages.optimizers.items()) if s in zero}

    def _where(self) -> Where:
        return Where(self.place.global_rank, self.place.rank, self.place.replica)

    def save_shard(self, stages: Stages, directory: str, blocking: bool = True) -> tuple:
        """Write this actor's shard of a checkpoint into ``directory``: its stages' files (on the
        first replica only: the replicas hold the same state) and its RNG state.  ``blocking``:
        written before this returns.  Otherwise the state is copied now (under the lock, after
        the steps before this call) and a thread writes it while steps go on, leaving a marker.
        A ``ShardReport`` as a tuple; a failure is in it, not raised."""
        self.join_writer()
        where, tp_rank = self._where(), self.place.tp_rank
        try:
            first = self.place.replica == 0 and self.place.cp_rank == 0  # CP ranks hold the same parameters too
            states = self.checkpoint_state(stages, snapshot=not blocking) if first else {}
            shards = self.optimizer_shards(stages, snapshot=not blocking)  # ZeRO-1: every replica writes its own
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

    def join_writer(self) -> None:
        """Wait for the asynchronous shard write in flight, if any, to finish (or fail)."""
        if self._writer is not None:
            self._writer.join()

    def read_shard(self, stages: Stages, directory: str, rng: bool) -> tuple:
        """Read the files of this actor's stages (and, ``rng``, of its RNG state) from the
        checkpoint ``directory`` and hold them for ``apply_shard``; the report has the shapes
        read, for the controller to check, or the error."""
        where = self._where()
        self._staged = None
        error, states, rng_state = read_files(directory, where, sorted(stages.modules), rng)
        if error is None:
            self._staged = (states, rng_state)
        return tuple(ShardReport(where.index, shapes_of(states), error))

    def apply_shard(self, stages: Stages, apply: bool = True) -> None:
        """Load what ``read_shard`` read (``apply``), or drop it."""
        staged, self._staged = self._staged, None
        if not apply:
            return
        if staged is None:
            raise RuntimeError("apply_shard without a successful read_shard")
        states, rng = staged
        self.load_checkpoint_state(stages, states)
        if rng is not None:
            self.set_rng_state(rng)

    @staticmethod
    def load_checkpoint_state(stages: Stages, states: dict) -> None:
        for s, state in states.items():
            stages.modules[int(s)].load_state_dict(local_state(stages.modules[int(s)], state["module"]))
            opt, sched = stages.optimizers.get(int(s)), stages.schedulers.get(int(s))
            if opt is not None:
                _load_optimizer(stages, int(s), opt, state)
            if sched is not None and state.get("scheduler") is not None:
                sched.load_state_dict(state["scheduler"])
            if stages.loss_scale is not None and state.get("loss_scale"):
                for name, value in state["loss_scale"].items():
                    setattr(stages.loss_scale, name, value)

    # -- RNG -----------------------------------------------------------------------------------
    def rng_state(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.place.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.place.device)
        return state

    def set_rng_state(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if self.place.device.type == "cuda" and "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.place.device)


def _load_optimizer(stages: Stages, s: int, opt, state: dict) -> None:
    """Stage ``s``'s optimizer state from a checkpoint written under any dp and zero (Note
    [ZeRO-1 sharding]): by parameter name, unless both sides hold it whole."""
    zero = stages.zero.get(s)
    named = merge_named(state["optimizer_named"]) if state.get("optimizer_named") else None
    params = [p for g in opt.param_groups for p in g["params"]]  # whole tensors cut to this actor's part
    if named is None and state.get("optimizer") is not None:
        if zero is None:
            opt.load_state_dict(local_optimizer_state(state["optimizer"], params))
            return
        named = named_state(state["optimizer"], zero.full_order)
    if named is not None:
        names = zero.names if zero is not None else {id(p): n for n, p in stages.modules[s].named_parameters()}
        opt.load_state_dict(local_optimizer_state(positional_state(named, _order(opt, names)), params))


def _order(opt, names: dict) -> list[list[str]]:
    """The names of ``opt``'s parameters per group, as it holds them."""
    return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
