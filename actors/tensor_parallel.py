"""Tensor parallelism inside a stage, on the actors: the stage's modules sharded over the
actors of its pipeline rank as DTensors (``torch.distributed.tensor``), and the few places
where the runtime's own code reads parameters, gradients or state that DTensor shards.

Note [tensor parallelism]
~~~~~~~~~~~~~~~~~~~~~~~~~
With ``Pipeline(..., tp=T, tp_plan=...)`` every pipeline rank is ``T`` actors, the TP
group (Note [device grid] in actors/grid.py).  Each builds the whole stage in host memory, the
same on every TP rank (the same pickled module, or the factory under the same seed: Note [stage
factories]); on a GPU only the shards go to the device (``distribute_tensor`` moves one whole
weight at a time and keeps its slice; what the plan leaves whole follows after), so the
device never holds the whole stage.  It applies the stage's plan with ``parallelize_module`` on a
one-dimensional ``DeviceMesh`` over the TP group: a module's weight becomes a DTensor holding
this actor's shard, sliced from its own copy (``src_data_rank=None``: no scatter at start-up,
and none of the scatters gloo cannot do on CUDA tensors), and the parallel styles turn its
inputs and outputs into DTensors and back into plain tensors at the module's edges.
What the rest of the runtime sees:

* Values between stages stay plain, replicated tensors: the plans end every stage in
  replicated values (the row-parallel layers all-reduce, a sequence-parallel stage gathers
  its last layer's output), so TP rank ``t`` sends its copy of the boundary value to TP
  rank ``t`` of the next stage (``T`` parallel links, nothing gathered on one actor).  The
  LM head all-gathers its logits, so the loss sees them whole, or, with
  ``Pipeline(loss_parallel=True)``, leaves them a DTensor sharded over the vocabulary and
  the last stage's forward and backward instructions run under ``loss_parallel()`` (Note
  [vocabulary-parallel loss] in mpmd/tensor_parallel/builtin.py; ``predict`` gathers them).
  Every TP rank of the last stage computes the same loss; only TP rank 0 reports it.
* The stage's collectives (DTensor's, in forward and backward) run on the TP group; every
  TP rank runs the same program, so they come in the same order on every member.  On NCCL
  this keeps the point-to-point order of Note [NCCL order] (schedules/posting.py) free of
  deadlock: the TP ranks of a group post the same operations in the same order, TP rank t's
  sends and receives go to TP rank t only, so the grid behaves as ``tp`` copies of the
  ``tp=1`` pipeline that meet only inside a group's collectives, which every member reaches
  at the same instruction; the ordering model checks the ``tp=1`` programs, which are the
  programs every TP rank runs.
* Gradients of a sharded parameter are DTensors; once laid out as their parameter
  (``align_grads``: DTensor may hand a vocab-parallel embedding's gradient back whole) the
  local part is the gradient of this actor's shard.  The runtime's own reductions (the data-parallel mean, ZeRO-1's
  reduce-scatter and gather, a tie's sum, the fp16 unscale, clipping) work on the local
  parts (``local``): along ``dp`` and along a tie, TP rank ``t`` talks only to TP rank ``t``,
  whose shard is the same slice.
* Split-backward schedules (zb-h1, zb-h2, zbv, dualpipev) run on sharded stages: ``I`` takes
  the stage input's gradient, whose TP all-reduces sit on the input path; ``W`` the weights'
  gradients, which a column- or row-parallel weight gets from its local shard (no
  collective).  Whatever collective either half runs, every TP rank runs it at the same
  instruction of the same program.
* The optimizers step with every parameter list taken as DTensors (``step``): the plans
  leave some parameters plain beside DTensor ones (Llama's norms, GPT's attention), and
  the ``foreach`` and ``fused`` kernels CUDA's optimizers default to refuse a list that
  mixes the two ("got mixed torch.Tensor and DTensor").  Under DTensor's
  ``implicit_replication`` a plain parameter, the same on every TP rank, is taken as
  replicated: each kernel updates its local storage as the single-tensor loop does.
  ``SGD(fused=True)`` has no DTensor rule at all and is refused when set up.
* The global gradient norm and the non-finite check (Note [agreed update]) count every
  element once: a sharded parameter's local part on every TP rank, a replicated one
  (a norm's weight, a row-parallel bias: equal on every TP rank) on TP rank 0 only.
* Checkpoints are written and read shard by shard (Note [checkpoint pieces] in
  actors/pieces.py): each TP rank writes its pieces with their offsets in the whole
  tensors, and a load cuts each actor's box out of whatever pieces (or whole tensors) the
  files hold, so a checkpoint loads at any ``tp`` (and ``dp``, ``zero``); the optimizer's
  state tensors shaped like their parameter are cut like it.  ``state_dict`` (the
  controller's whole model) is still gathered over the TP group (``full_tensor``, on every
  TP rank alike); a whole state dict loads by slicing (``distribute_tensor`` without
  communication, ``src_data_rank=None``).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .pieces import is_pieces, like

__all__ = ["local", "align_grads", "is_sharded", "counted_here", "tp_mesh", "apply_plan", "full_state", "whole", "local_state",
           "local_optimizer_state", "check_tie_placements", "TIE_LAYOUT_FIX", "placement_of", "step",
           "check_optimizer", "install_rng_tracker"]

Plan = Union[dict, Callable[[int, torch.nn.Module, DeviceMesh], None], None]


def local(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """This actor's part of ``t`` (a DTensor's local tensor, which shares its storage), or ``t``."""
    return t.to_local() if isinstance(t, DTensor) else t


def align_grads(params) -> None:
    """Lay each DTensor parameter's gradient out as the parameter (DTensor may leave one
    otherwise: a vocab-parallel embedding's weight gradient comes out replicated, whole), so
    that its local part is the gradient of this actor's shard (or, replicated, the whole
    gradient).  Replicated to sharded is a slice; partial (a Qwen3 per-head norm's weight
    under SequenceParallel) to replicated an all-reduce over the TP group, to sharded a
    reduce-scatter: every TP rank calls this at the same point of the same program."""
    for p in params:
        g = p.grad
        if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
            p.grad = g.redistribute(p.device_mesh, p.placements)


def _sharded_params(opt: torch.optim.Optimizer) -> bool:
    return any(isinstance(p, DTensor) for group in opt.param_groups for p in group["params"])


def step(opt: torch.optim.Optimizer) -> None:
    """``opt.step()``, its plain parameters taken as replicated DTensors where others are
    DTensors (Note [tensor parallelism]: CUDA's default foreach and fused kernels)."""
    if not _sharded_params(opt):
        opt.step()
        return
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        opt.step()


def check_optimizer(opt: torch.optim.Optimizer, stage: int) -> None:
    """Refuse an optimizer whose kernels DTensor cannot run, before the first step."""
    if _sharded_params(opt) and isinstance(opt, torch.optim.SGD) and any(g.get("fused") for g in opt.param_groups):
        raise ValueError(f"stage {stage} is tensor-parallel and its optimizer is SGD(fused=True), whose kernel "
                         f"DTensor has no sharding rule for; use SGD(foreach=True) (as fast on CUDA) or tp=1")


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is split over the TP group (each actor holds a different part)."""
    return isinstance(p, DTensor) and any(not pl.is_replicate() for pl in p.placements)


def counted_here(p: torch.Tensor, tp_rank: int) -> bool:
    """Whether this actor counts ``p`` in the global norm: its shard, or a replicated one on TP rank 0."""
    return tp_rank == 0 or is_sharded(p)


def placement_of(p: torch.Tensor) -> tuple:
    """How ``p`` is laid out over the TP group (``()``: a plain, replicated tensor)."""
    return tuple(p.placements) if isinstance(p, DTensor) else ()


_meshes_made = [0]  # in this process, ever (a process reused by the next pipeline: StageWorker.rebind)


def tp_mesh(group, device: torch.device) -> DeviceMesh:
    """The one-dimensional mesh over the TP ``group`` (formed by the Communicator).

    Its dimension is named ``"tp"`` in a new process and ``"tp<n>"`` for the process's n-th
    mesh: DTensor's process-wide caches (sharding propagation, redistribute plans) compare
    meshes by ranks, layout and dimension names, not by process group, so the mesh of a
    pipeline on a reused process (Note [reused actors] in mpmd/runtime/pool.py) would find the
    last pipeline's entries and run its collectives on that pipeline's destroyed groups
    ("Could not resolve the process group registered under the name 1"), or on a live group
    that took the old one's name."""
    _meshes_made[0] += 1
    name = "tp" if _meshes_made[0] == 1 else f"tp{_meshes_made[0]}"
    mesh = DeviceMesh.from_group(group, device.type, mesh_dim_names=(name,))
    install_rng_tracker(mesh)
    return mesh


def install_rng_tracker(mesh: DeviceMesh) -> None:
    """Give DTensor's random ops (a dropout on a sharded activation) their RNG tracker now.
    Left to itself, DTensor makes one at the first such op and syncs its state by a broadcast
    from rank 0 of the *world* group, which only this stage's actors reach: a hang.  No sync
    is needed: every actor is seeded alike (``torch.manual_seed(seed)``) and the TP ranks of a
    stage draw in the same order.  (DTensor keeps no tracker for a CPU mesh.)"""
    from torch.distributed.tensor import _random

    if _random._rng_tracker is None and _random.is_rng_supported_mesh(mesh):
        _random._rng_tracker = _random.OffsetBasedRNGTracker(mesh, run_state_sync=False)


def apply_plan(module: torch.nn.Module, plan: Plan, mesh: DeviceMesh, stage: int) -> None:
    """Shard stage ``stage``'s ``module`` over ``mesh`` by ``plan``: ``{module name: ParallelStyle}``
    (names relative to the stage, resolved on the controller by mpmd/tensor_parallel) or a
    function ``(stage, module, mesh)``.  An entry that fails names its module."""
    if plan is None:
        return
    if callable(plan):
        try:
            plan(stage, module, mesh)
        except Exception as e:
            raise RuntimeError(f"the tp_plan function failed on stage {stage}: {type(e).__name__}: {e}") from e
        return
    from torch.distributed.tensor.parallel import parallelize_module

    tied = _tied_slots(module)
    for name, style in plan.items():
        try:
            target = module.get_submodule(name)
        except AttributeError:
            raise ValueError(f"tp_plan names {name!r}, which stage {stage} does not have") from None
        try:
            parallelize_module(target, mesh, style, src_data_rank=None)  # each slices its own copy: no scatter
        except Exception as e:
            raise RuntimeError(f"tp_plan could not apply {type(style).__name__} to stage {stage}'s module {name!r} "
                               f"({type(target).__name__}): {type(e).__name__}: {e}") from e
    # parallelize_module gives each module its own DTensor parameter: a parameter the stage holds
    # under two names (a tied embedding and head in one stage) is tied again.
    for slots in tied:
        owner, attr, name = slots[0]
        kept = getattr(owner, attr)
        for other, other_attr, other_name in slots[1:]:
            now = getattr(other, other_attr)
            if now is not kept:
                check_tie_placements([kept, now], [name, other_name])
                setattr(other, other_attr, kept)


def _tied_slots(module: torch.nn.Module) -> list[list[tuple]]:
    """Groups of (owning module, attribute, full name) holding one parameter, for those held twice."""
    slots: dict = {}
    for mname, sub in module.named_modules(remove_duplicate=False):
        for attr, p in sub.named_parameters(recurse=False, remove_duplicate=False):
            slots.setdefault(id(p), []).append((sub, attr, f"{mname}.{attr}" if mname else attr))
    groups = [list({(id(o), a): (o, a, n) for o, a, n in group}.values()) for group in slots.values()]
    return [g for g in groups if len(g) > 1]


def full_state(state: dict) -> dict:
    """``state`` with every DTensor gathered whole (a collective over the TP group: every TP
    rank calls it with the same keys in the same order)."""
    return {k: whole(v) for k, v in state.items()}


def whole(v: Any) -> Any:
    """``v`` with each DTensor in it gathered whole (a collective over the TP group)."""
    if isinstance(v, DTensor):
        return v.full_tensor()
    if isinstance(v, dict):
        return {k: whole(x) for k, x in v.items()}
    if isinstance(v, list):
        return [whole(x) for x in v]
    return v


def local_state(module: torch.nn.Module, state: dict) -> dict:
    """A whole-tensor state dict for ``module`` with each value of a sharded entry cut to
    this actor's part (no communication: every actor holds the whole tensor)."""
    current = module.state_dict()
    return {k: _like(current.get(k), v) for k, v in state.items()}


def _like(ref: Any, v: Any) -> Any:
    if is_pieces(v):  # Note [checkpoint pieces] in actors/pieces.py
        return like(ref, v)
    if not isinstance(ref, DTensor) or not isinstance(v, torch.Tensor) or isinstance(v, DTensor):
        return v
    if tuple(v.shape) != tuple(ref.shape):
        raise ValueError(f"a tensor of shape {tuple(v.shape)} cannot be sharded like one of shape {tuple(ref.shape)}")
    return distribute_tensor(v.to(ref.device), ref.device_mesh, ref.placements, src_data_rank=None)


def local_optimizer_state(opt_state: dict, params: list) -> dict:
    """A positional optimizer ``state_dict`` of whole tensors for an optimizer over ``params``
    (in its order): each state tensor shaped like its DTensor parameter is cut like it."""
    state = {}
    for i, st in opt_state["state"].items():
        p = params[int(i)]
        state[i] = {k: (_like(p, v) if is_pieces(v) or isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                    for k, v in st.items()}
    return {**opt_state, "state": state}


TIE_LAYOUT_FIX = ("tensor parallelism sums a tie's gradients shard by shard, so give every copy the same layout "
                  "(e.g. a vocab-parallel embedding, RowwiseParallel, with a ColwiseParallel head: both split the "
                  "[vocab, hidden] weight on dim 0) or untie them")


def check_tie_placements(copies: list, names: list[str]) -> None:
    """Refuse a tie whose copies a plan shards differently: their local gradients would not be
    the same slice (Note [tensor parallelism])."""
    layouts = [placement_of(p) for p in copies]
    if any(layout != layouts[0] for layout in layouts):
        described = ", ".join(f"{n}: {list(map(str, lay)) or 'replicated'}" for n, lay in zip(names, layouts))
        raise ValueError(f"a tied parameter is sharded differently on its stages ({described}); {TIE_LAYOUT_FIX}")
