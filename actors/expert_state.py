"""The state of an expert-parallel stage: its expert tensors (and the optimizer state shaped
like them) as pieces of the whole tensors, and each actor's box cut back out of them.

Note [expert pieces]
~~~~~~~~~~~~~~~~~~~~
At ``ep > 1`` an actor holds experts ``[first, first + E/ep)`` of each MoE block's fused
expert parameters (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) as plain tensors of
shape ``[E/ep, ...]`` under the model's own names (Note [expert parallelism] in
actors/experts.py; ``expert_ranges(module)`` gives ``name -> (first, E)``).  Everything that
leaves the actor speaks of the *whole* tensor, so nothing outside depends on ``ep``:

* **Checkpoints** (Note [checkpoint pieces] in actors/pieces.py): an expert tensor is written
  as one piece at offset ``(first, 0, 0)`` of its whole shape ``[E, ...]``.  The members of EP
  group 0 write (members ``0..ep-1`` of the rank's ``dp x cp``, ``DeviceGrid.ep_member``: at ``cp >
  1`` CP ranks other than 0 among them, Note [expert parallelism] in actors/grid.py): EP rank 0
  (member 0) writes the stage's file ``stage-0003.pt`` as before; EP rank ``e`` writes
  ``stage-0003.ep-000e.pt`` holding only its expert pieces (``None`` elsewhere), and the stage
  file says how many (``"ep_parts"``).  The optimizer's state of the expert parameters goes by
  parameter name under ``"expert_optimizer"`` in the same files, as pieces too, never in the
  positional ``"optimizer"`` nor in ZeRO-1's ``optim-SSSS-RRRR.pt`` shards (ZeRO-1 shards only
  the dense parameters' state; each EP rank steps its own experts): so an expert's moments sit
  beside its weights, written once per EP rank, not once per replica.
* **Loading** merges the parts' pieces and cuts each actor's box under the *new* layout
  (``cut_to_box``: its expert range, or the whole tensor at ``ep=1``); a whole tensor (a
  checkpoint written at ``ep=1``, or ``pipe.load_state_dict``'s argument) is sliced the same
  way.  So ``ep=2 <-> ep=1``, with any dp, cp and zero, reads the same files.
* **``pipe.state_dict()``** asks EP ranks ``0..ep-1`` of EP group 0 (the same members); rank 0 answers the
  whole state with its experts as pieces, the others their expert pieces only, and the
  controller assembles whole tensors (``whole_state``): no collective runs on the actors.
  ``state_shapes`` reports whole shapes, so the controller's checks see the model's tensors.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from .pieces import PIECES, assemble, box_slices, is_pieces, merge_parts

__all__ = ["ExpertBox", "expert_boxes", "expert_pieces", "cut_to_box", "cut_experts", "whole_shapes",
           "split_expert_optimizer", "cut_named_state", "without_experts", "whole_state"]


class ExpertBox(NamedTuple):
    """Where an actor's expert tensor sits in the whole one: ``offset`` ``(first, 0, ...)``,
    its own ``shape`` ``[E/ep, ...]`` and the ``whole`` shape ``[E, ...]``."""

    offset: list
    shape: list
    whole: list


def expert_boxes(module: torch.nn.Module, ranges: dict[str, tuple[int, int]]) -> dict[str, ExpertBox]:
    """``name -> ExpertBox`` of ``module``'s expert parameters; ``ranges``: ``expert_ranges(module)``."""
    params = dict(module.named_parameters())
    out = {}
    for name, (first, num_experts) in ranges.items():
        shape = list(params[name].shape)
        out[name] = ExpertBox([first] + [0] * (len(shape) - 1), shape, [num_experts] + shape[1:])
    return out


def _piece(value: torch.Tensor, box: ExpertBox) -> dict:
    return {PIECES: [{"offset": list(box.offset), "tensor": value.detach()}], "shape": list(box.whole)}


def expert_pieces(state: dict, boxes: dict[str, ExpertBox]) -> dict:
    """A module state dict with each expert tensor as its piece of the whole tensor."""
    return {k: _piece(v, boxes[k]) if k in boxes else v for k, v in state.items()}


def cut_to_box(value: Any, box: ExpertBox, name: str = "an expert tensor") -> Any:
    """This actor's box of ``value``: pieces of the whole tensor (only the pages under the box
    are read), or a whole tensor sliced; anything else (a scalar step count) as it is."""
    if is_pieces(value):
        if list(value["shape"]) != list(box.whole):
            raise ValueError(f"{name} has {value['shape'][0]} experts of shape {value['shape'][1:]} in the checkpoint, "
                             f"but this model's has {box.whole[0]} of shape {box.whole[1:]}; load it into the model "
                             f"it was written from")
        return assemble(value, box.offset, box.shape, name)
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        if list(value.shape) == list(box.whole):
            return value[box_slices(box.offset, box.shape)]
        if list(value.shape) != list(box.shape) or box.shape != box.whole:
            raise ValueError(f"{name} has shape {list(value.shape)}, but the whole tensor has shape {box.whole} "
                             f"(this actor holds experts {box.offset[0]}..{box.offset[0] + box.shape[0] - 1})")
    return value


def cut_experts(state: dict, boxes: dict[str, ExpertBox]) -> dict:
    """A state dict of whole tensors (or pieces) with each expert tensor cut to this actor's box."""
    return {k: cut_to_box(v, boxes[k], k) if k in boxes else v for k, v in state.items()}


def whole_shapes(shapes: dict, boxes: dict[str, ExpertBox]) -> dict:
    """``{key: shape}`` with the expert tensors' whole shapes."""
    return {k: tuple(boxes[k].whole) if k in boxes else v for k, v in shapes.items()}


def _state_pieces(state: dict, box: ExpertBox) -> dict:
    """One parameter's optimizer state with each tensor shaped like the parameter as a piece."""
    return {k: _piece(v, box) if isinstance(v, torch.Tensor) and list(v.shape) == list(box.shape) else v
            for k, v in state.items()}


def split_expert_optimizer(opt_state: dict, order: list[list[str]], boxes: dict[str, ExpertBox]) -> tuple[dict, dict]:
    """A positional optimizer ``state_dict`` (``order``: its parameters' names per group) as
    ``(the same without the expert parameters' state, {expert name: its state as pieces})``
    (Note [expert pieces]); the param groups keep every parameter, so positions do not move."""
    flat = [n for group in order for n in group]
    dense, experts = {}, {}
    for i, st in opt_state["state"].items():
        name = flat[int(i)]
        if name in boxes:
            experts[name] = _state_pieces(st, boxes[name])
        else:
            dense[i] = st
    return {**opt_state, "state": dense}, experts


def without_experts(named: dict, boxes: dict[str, ExpertBox]) -> dict:
    """A named optimizer state (ZeRO-1's shard) without the expert parameters' state."""
    return {**named, "state": {n: st for n, st in named["state"].items() if n not in boxes}}


def cut_named_state(state: dict, boxes: dict[str, ExpertBox]) -> dict:
    """``{name: optimizer state}`` with every expert parameter's tensors cut to this actor's box."""
    return {n: ({k: cut_to_box(v, boxes[n], f"the optimizer's {k!r} of {n}") for k, v in st.items()}
                if n in boxes else st) for n, st in state.items()}


def _assembled(value: Any) -> Any:
    if is_pieces(value):
        return assemble(value, name="an expert tensor")
    if isinstance(value, dict):
        return {k: _assembled(v) for k, v in value.items()}
    return value


def whole_state(parts: list[dict]) -> dict:
    """``{stage: state dict}`` of whole tensors from EP rank 0's answer and the other EP
    ranks' expert pieces (``parts``, in EP rank order; Note [expert pieces])."""
    merged = parts[0]
    for part in parts[1:]:
        merged = merge_parts(merged, part)
    return {s: _assembled(st) for s, st in merged.items()}
