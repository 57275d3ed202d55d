"""The compute of one stage on one microbatch: forward, backward, and the split
backward (``I`` input gradient, ``W`` weight gradient) of the zero-bubble schedules."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Optional

import torch
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from .errors import LossFnError
from .experts import loss_scale
from .split_backward import apply_weight_seeds, capture_input_and_seeds
from .values import describe, flatten, unflatten

__all__ = ["Slot", "forward", "backward_full", "backward_input", "backward_weight", "detach_for_next"]


@dataclasses.dataclass
class Slot:
    """Everything held for one (stage, microbatch) between its forward and backward."""

    inp: Any = None  # the stage's input value (detached from the previous stage)
    inp_grad: list = dataclasses.field(default_factory=list)  # input tensors that receive gradients
    out: Any = None  # the stage's output value, graph attached
    out_float: list = dataclasses.field(default_factory=list)  # floating-point output tensors
    loss: Optional[torch.Tensor] = None  # last stage: loss / num_microbatches
    grad_out: Optional[list] = None  # gradients of out_float, from the next stage
    grad_in: Optional[list] = None  # gradients of inp_grad, for the previous stage
    weight_seeds: Optional[list] = None  # captured by I for W (Note [weight seeds])
    replay: Optional[Callable[[], None]] = None  # recomputes the forward at I (Note [recompute at I])


def detach_for_next(value: Any, requires_grad: bool) -> tuple[Any, list[torch.Tensor]]:
    """Cut the graph at a stage boundary; float tensors become gradient leaves."""
    spec, tensors = flatten(value)
    leaves = []
    fresh = []
    for t in tensors:
        t = t.detach()
        if requires_grad and t.is_floating_point():
            t.requires_grad_(True)
            leaves.append(t)
        fresh.append(t)
    return unflatten(spec, fresh), leaves


def forward(module: torch.nn.Module, slot: Slot, target: Any, loss_fn: Optional[Callable], scale: float,
            side: Optional[dict] = None, loss_side: Optional[dict] = None, *,
            autocast: Optional[tuple[str, torch.dtype]] = None, boundary: bool = False,
            recompute: bool = False, split: bool = False) -> None:
    """Run the stage (``side``: keyword arguments for it) and, on the last stage, the loss
    (``loss_side``: keyword arguments for ``loss_fn``) scaled by ``scale``.

    ``autocast=(device_type, dtype)`` runs both under ``torch.autocast``; with ``boundary``
    (a stage whose output goes on to another stage) the output's floating-point tensors
    are cast to that dtype, Note [precision boundary].  ``recompute`` keeps only the
    stage's input and recomputes its forward inside the backward (non-reentrant
    ``torch.utils.checkpoint``: the autocast state and the RNG state are replayed), or,
    when the backward is ``split`` (I then W), once at I (Note [recompute at I]).  The stage runs
    under ``loss_scale(scale)``: its MoE blocks' auxiliary losses train with the microbatch
    loss's factor (actors/experts.py)."""
    if recompute and split:
        rng = _rng_state(module)
        with torch.no_grad():
            forward(module, slot, target, loss_fn, scale, side, loss_side, autocast=autocast, boundary=boundary)

        def replay() -> None:
            with torch.random.fork_rng(devices=rng[1], device_type="cuda"):
                torch.set_rng_state(rng[0])
                for device, state in zip(rng[1], rng[2]):
                    torch.cuda.set_rng_state(state, device)
                forward(module, slot, target, loss_fn, scale, side, loss_side, autocast=autocast, boundary=boundary)

        slot.replay = replay
        return
    with torch.autocast(autocast[0], dtype=autocast[1]) if autocast else contextlib.nullcontext():
        if recompute:
            out = checkpoint(_run, module, slot.inp, side or {}, scale, use_reentrant=False)
        else:
            with loss_scale(scale):
                out = module(slot.inp, **side) if side else module(slot.inp)
        if boundary and autocast:
            spec, tensors = flatten(out, where="stage output")
            out = unflatten(spec, [t.to(autocast[1]) if t.is_floating_point() else t for t in tensors])
        _finish_forward(slot, out, target, loss_fn, scale, loss_side)


# Note [recompute at I]: torch.utils.checkpoint recomputes a stage's forward once per
# backward pass that reaches it, and W runs one pass per weight node (Note [weight seeds]):
# a 2-layer Llama stage recomputed its forward 18 times per microbatch.  So a recomputed
# stage whose backward is split runs its forward without a graph (the output goes on as
# usual), keeps its input and the RNG state, and at I runs the forward again with the graph
# (RNG replayed as checkpoint does), which I and then W use: two forwards per microbatch,
# and between I and W the activations a split backward without recompute keeps.

# Note [precision boundary]: with precision="bf16" (or "fp16") a stage's output crosses to
# the next stage in the autocast dtype, whether the next stage is on another actor (half
# the bytes on the wire) or on the same one: the result never depends on the placement.
# Gradients come back in that dtype too.  The single-process reference casts there too.


def _run(module: torch.nn.Module, inp: Any, side: dict, scale: float) -> Any:
    with loss_scale(scale):  # the recomputation inside the backward too
        return module(inp, **side)


def _rng_state(module: torch.nn.Module) -> tuple:
    """The CPU RNG state and, when the stage is on CUDA, its device's (what a replay restores)."""
    devices = sorted({p.device.index or 0 for p in module.parameters() if p.device.type == "cuda"})
    return torch.get_rng_state(), devices, [torch.cuda.get_rng_state(d) for d in devices]


def _finish_forward(slot: Slot, out: Any, target: Any, loss_fn: Optional[Callable], scale: float,
                    loss_side: Optional[dict]) -> None:
    slot.out = out
    _, tensors = flatten(out, where="stage output")
    slot.out_float = [t for t in tensors if t.is_floating_point()]
    if loss_fn is not None and target is not None:
        slot.loss = _loss(loss_fn, out, target, loss_side) * scale


def _loss(loss_fn: Callable, out: Any, target: Any, loss_side: Optional[dict]) -> torch.Tensor:
    """``loss_fn(out, target)``; what goes wrong there is the loss function's, not the stage's."""
    def got() -> str:
        return f"the last stage's output: {describe(out)}; the targets: {describe(target)}"

    name = getattr(loss_fn, "__qualname__", None) or type(loss_fn).__name__
    try:
        loss = loss_fn(out, target, **loss_side) if loss_side else loss_fn(out, target)
    except Exception as exc:  # noqa: BLE001 - re-raised, naming the loss function and what it got
        raise LossFnError(f"loss_fn {name} raised {type(exc).__name__}: {exc}\n  {got()}") from exc
    if not isinstance(loss, torch.Tensor):
        raise LossFnError(f"loss_fn {name} returned a {type(loss).__name__}, not a scalar tensor; return a torch "
                          f"tensor with one element that autograd can differentiate\n  {got()}")
    if loss.numel() != 1:
        raise LossFnError(f"loss_fn {name} returned a tensor of shape {tuple(loss.shape)}, not a scalar: reduce it "
                          f"to one number per microbatch (e.g. .mean(), or reduction='mean')\n  {got()}")
    if isinstance(loss, DTensor):  # computed on vocabulary shards: the same on every TP rank
        return loss.full_tensor()
    return loss


def _roots(slot: Slot) -> tuple[list, Optional[list]]:
    if slot.loss is not None:
        return [slot.loss], None
    if slot.grad_out is None:
        raise RuntimeError("backward without the output gradient (no RECV_B or local hand-off before it)")
    pairs = [(o, g) for o, g in zip(slot.out_float, slot.grad_out) if o.requires_grad]
    return [o for o, _ in pairs], [g for _, g in pairs]


def _input_grads(slot: Slot) -> list[torch.Tensor]:
    return [t.grad if t.grad is not None else torch.zeros_like(t) for t in slot.inp_grad]


def backward_full(slot: Slot) -> None:
    roots, grads = _roots(slot)
    if roots:
        torch.autograd.backward(roots, grads)
    slot.grad_in = _input_grads(slot)


def backward_input(module: torch.nn.Module, slot: Slot) -> None:
    """``I``: gradient with respect to the stage input, and the gradients ``W`` will start
    from (Note [weight seeds] in actors/split_backward.py); the graph is kept for ``W``."""
    if slot.replay is not None:  # recomputed here, once (Note [recompute at I])
        slot.replay, replay = None, slot.replay
        replay()
    roots, grads = _roots(slot)
    if not (roots and slot.inp_grad):
        slot.grad_in = [torch.zeros_like(t) for t in slot.inp_grad]
        return  # nothing flows to the input: W does the whole backward
    got = capture_input_and_seeds(roots, grads, slot.inp_grad, _params(module))
    if got is None:  # not exactly splittable: W walks the backward again
        got = torch.autograd.grad(roots, slot.inp_grad, grads, retain_graph=True, allow_unused=True), None
    grad_in, slot.weight_seeds = got
    slot.grad_in = [g if g is not None else torch.zeros_like(t) for g, t in zip(grad_in, slot.inp_grad)]


def backward_weight(module: torch.nn.Module, slot: Slot) -> None:
    """``W``: accumulate parameter gradients, then release the graph."""
    if slot.weight_seeds is not None:
        apply_weight_seeds(slot.weight_seeds)
    else:
        roots, grads = _roots(slot)
        params = list(_params(module).values())
        if roots and params:
            torch.autograd.backward(roots, grads, inputs=params)
    slot.out = slot.loss = slot.weight_seeds = None
    slot.out_float = []


def _params(module: torch.nn.Module) -> dict[int, torch.Tensor]:
    return {id(p): p for p in module.parameters() if p.requires_grad}
