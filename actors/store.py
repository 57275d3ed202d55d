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
from .expert_state import (cut_experts, cut_named_state, expert_boxes, expert_pieces, split_expert_optimizer,
                           whole_shapes, without_experts)
from .experts import expert_ranges
from .hf_io import expert_slices, read_safetensors, write_safetensors
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
        the others answer ``{}``, so the controller receives each stage once.  Under EP (EP
        ranks ``0..ep-1`` of EP group 0, members ``0..ep-1``, are asked) EP rank 0 answers everything, its
        experts as pieces, the others their expert pieces only (Note [expert pieces])."""
        keep, ep_rank = not self.place.tp_rank, self._ep_rank()
        out = {}
        for s, m in sorted(stages.modules.items()):
            state, boxes = {}, _boxes(m)
            for k, v in m.state_dict().items():
                v = whole(v).detach()  # a collective for a DTensor: every TP rank, same order
                if keep and (not ep_rank or k in boxes):
                    state[k] = v.cpu()
            if keep:
                out[s] = expert_pieces(state, boxes)
        return out

    @staticmethod
    def state_shapes(stages: Stages) -> dict:
        """``{stage: {key: whole shape}}``: what ``load_state_dict`` must be given (no communication)."""
        return {s: whole_shapes({k: tuple(v.shape) for k, v in m.state_dict().items()}, _boxes(m))
                for s, m in sorted(stages.modules.items())}

    def _ep_rank(self) -> int:
        """This actor's rank in its EP group (member ``m = replica x cp + CP rank`` is EP rank ``m % ep``:
        Note [expert parallelism] in actors/grid.py)."""
        return self.place.grid.ep_rank(self.place.replica, self.place.cp_rank)

    def export_stage(self, stages: Stages, path: str, names: dict, dtype: Optional[str] = None,
                     experts: Optional[dict] = None) -> dict:
        """Write this actor's part of a Hugging Face export to ``path`` (every TP rank of a stage
        together: ``write_safetensors``; ``experts``: the EP ranks' slices of the expert tensors
        it writes, ``expert_slices``); ``{exported key: bytes}``."""
        return write_safetensors(path, stages.modules, names, self.place.tp_rank, self.place.grid.tp,
                                 getattr(torch, dtype) if dtype else None, experts)

    @staticmethod
    def expert_slices(stages: Stages, names: dict) -> dict:
        """This actor's slices of the expert tensors among ``names`` (stage -> keys), in Ray's
        object store for the actors that export them whole (Note [export from the actors])."""
        return expert_slices(stages.modules, names, {s: _boxes(m) for s, m in stages.modules.items()})

    @staticmethod
    def import_stage(stages: Stages, directory: str, names: dict, weight_map: dict) -> None:
        """Copy this actor's part of a model's safetensors files into its stages (``read_safetensors``)."""
        read_safetensors(directory, stages.modules, names, weight_map)

    @staticmethod
    def load_state_dict(stages: Stages, numbers: list, states: tuple) -> None:
        """Load ``states[i]`` (whole tensors, this actor keeping its part) into stage ``numbers[i]``."""
        for s, sd in zip(numbers, states, strict=True):
            m = stages.modules[int(s)]
            m.load_state_dict(local_state(m, cut_experts(sd, _boxes(m))))

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
            boxes = _boxes(m)  # Note [expert pieces]: experts as pieces, their optimizer state by name
            dense, experts = to_pieces(opt.state_dict()) if opt is not None else None, {}
            if boxes and opt is not None:
                dense, experts = split_expert_optimizer(dense, _names(stages, s, opt), boxes)
            out[s] = {"module": copy_state(expert_pieces(to_pieces(m.state_dict()), boxes), snapshot),
                      "optimizer": copy_state(dense, snapshot) if not zero else None,  # Note [checkpoint pieces]
                      "scheduler": copy.deepcopy(sched_state) if snapshot else sched_state,
                      "loss_scale": dataclasses.asdict(stages.loss_scale) if stages.loss_scale is not None else None}
            if zero and opt is not None:
                out[s]["optimizer_shards"] = stages.dp
            if self.place.grid.tp > 1:
                out[s]["tp_parts"] = self.place.grid.tp
            if boxes:
                out[s]["expert_optimizer"] = copy_state(experts, snapshot)
                out[s]["ep_parts"] = self.place.grid.ep
        return out

    @staticmethod
    def optimizer_shards(stages: Stages, snapshot: bool = False) -> dict:
        """Under ZeRO-1, per stage, this replica's shard of its optimizer state by parameter name."""
        zero = stages.zero
        return {s: copy_state(without_experts(named_state(to_pieces(opt.state_dict()), _order(opt, zero[s].names)),
                                              _boxes(stages.modules[s])), snapshot)  # Note [expert pieces]
                for s, opt in sorted(stages.optimizers.items()) if s in zero}

    def _member(self) -> int:
        """This actor's index among its rank's ``dp x cp`` actors (``DeviceGrid.reduce_index``)."""
        return self.place.grid.reduce_index(self.place.replica, self.place.cp_rank)

    def _where(self) -> Where:
        return Where(self.place.global_rank, self.place.rank, self.place.replica, self._member())

    def save_shard(self, stages: Stages, directory: str, blocking: bool = True) -> tuple:
        """Write this actor's shard of a checkpoint into ``directory``: its stages' files (on the
        first member only: the replicas and CP ranks hold the same state; under EP on the first
        ``ep`` members, EP group 0, each its experts' part: Note [expert pieces]) and its RNG state.  ``blocking``:
        written before this returns.  Otherwise the state is copied now (under the lock, after
        the steps before this call) and a thread writes it while steps go on, leaving a marker.
        A ``ShardReport`` as a tuple; a failure is in it, not raised."""
        self.join_writer()
        where, tp_rank, ep_rank = self._where(), self.place.tp_rank, self._ep_rank()
        try:
            writes = self._member() < self.place.grid.ep  # EP group 0 (Note [expert pieces]); the rest hold copies
            states = self.checkpoint_state(stages, snapshot=not blocking) if writes else {}
            shards = self.optimizer_shards(stages, snapshot=not blocking)  # ZeRO-1: every dp x cp actor its own
            shapes = shapes_of(states) if not tp_rank and not ep_rank else {}
            if tp_rank:  # Note [checkpoint pieces]: its pieces; TP rank 0 writes the replicated values
                states, shards = part_of(states), part_of(shards)
            elif ep_rank:  # Note [expert pieces]: its experts (stages with any); EP rank 0 writes the rest
                states = {s: part_of(st) for s, st in states.items() if st.get("ep_parts")}
            rng = self.rng_state()
        except Exception as e:  # noqa: BLE001 - the save fails, the pipeline does not
            return tuple(ShardReport(where.index, {}, f"{where} could not take its state: {describe(e)}"))
        if blocking:
            error, nbytes = write_shard(directory, where, states, rng, shards, tp_rank, ep_rank)
            return tuple(ShardReport(where.index, shapes, error, nbytes))
        self._writer = ShardWriter(directory, where, states, rng, shards, tp_rank, ep_rank)
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
            m = stages.modules[int(s)]
            m.load_state_dict(local_state(m, cut_experts(state["module"], _boxes(m))))
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
    """Stage ``s``'s optimizer state from a checkpoint written under any dp, zero and ep (Note
    [ZeRO-1 sharding], Note [expert pieces]): by parameter name, unless both sides hold it
    whole and there are no experts to cut."""
    zero, boxes = stages.zero.get(s), _boxes(stages.modules[s])
    named = merge_named(state["optimizer_named"]) if state.get("optimizer_named") else None
    params = [p for g in opt.param_groups for p in g["params"]]  # whole tensors cut to this actor's part
    experts = state.get("expert_optimizer")
    if named is None and state.get("optimizer") is not None:
        if zero is None and not boxes and not experts:
            opt.load_state_dict(local_optimizer_state(state["optimizer"], params))
            return
        named = named_state(state["optimizer"], zero.full_order if zero is not None else _names(stages, s, opt))
    if named is not None:
        named = {**named, "state": cut_named_state({**named["state"], **(experts or {})}, boxes)}
        names = zero.names if zero is not None else _param_names(stages, s)
        opt.load_state_dict(local_optimizer_state(positional_state(named, _order(opt, names)), params))


def _boxes(module) -> dict:
    """Where ``module``'s expert parameters sit in the whole tensors (empty without EP)."""
    return expert_boxes(module, expert_ranges(module))


def _param_names(stages: Stages, s: int) -> dict:
    return {id(p): n for n, p in stages.modules[s].named_parameters()}


def _names(stages: Stages, s: int, opt) -> list[list[str]]:
    """The names of stage ``s``'s optimizer's parameters per group (under ZeRO-1: this shard's)."""
    zero = stages.zero.get(s)
    return _order(opt, zero.names if zero is not None else _param_names(stages, s))


def _order(opt, names: dict) -> list[list[str]]:
    """The names of ``opt``'s parameters per group, as it holds them."""
    return [[names[id(p)] for p in g["params"]] for g in opt.param_groups]
