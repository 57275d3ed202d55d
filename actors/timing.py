"""Timing a stage module on one microbatch with the actors' own stage code: forward,
backward fused and split into input and weight gradient, and the bytes a microbatch
holds.  The controller times copies of the stages with it (``mpmd.planning.measure``)
and an actor times its own stages (``WorkerState.time_stages``, Note [cost curve] in
mpmd/planning/costs.py)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from .stage_exec import Slot, backward_full, backward_input, backward_weight, detach_for_next, forward
from .values import flatten, unflatten

__all__ = ["Measurement", "measure_chain", "time_rows"]


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median seconds of one module on one microbatch, and its memory.

    ``b`` is the input-gradient backward (``I``), ``w`` the weight-gradient one (``W``),
    ``full`` a fused backward (``B``).  ``act_bytes`` is what the microbatch holds until
    its backward ends (saved tensors, input, output; parameters excluded);
    ``out_bytes`` the floating-point output sent on (and its gradient sent back);
    ``seed_bytes`` what a split backward holds from ``I`` to ``W`` besides the graph (the
    gradients ``W`` starts from, Note [weight seeds] in actors/split_backward.py).
    """

    f: float
    b: float
    w: float
    full: float
    act_bytes: int
    out_bytes: int
    param_bytes: int
    output: Any = dataclasses.field(repr=False, compare=False, default=None)
    seed_bytes: int = 0
    in_bytes: int = 0  # the input's tensors: what a recomputed stage keeps


def measure_chain(modules: Sequence[torch.nn.Module], inputs: Any, *, targets: Any = None,
                  loss_fn: Optional[Callable] = None, repeats: int = 5) -> list[Measurement]:
    """``measure_module`` for each module on the previous one's output (the loss on the last).

    The modules take turns, one run each per round, so a change in the machine's load
    during the measurement shifts every module alike instead of inflating one.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    timers, value = [], inputs
    for i, module in enumerate(modules):
        last = i == len(modules) - 1
        timers.append(_Timer(module, value, targets if last else None, loss_fn if last else None))
        value = timers[-1].output
    for t in timers:
        t.run(record=False)  # warm-up: allocator, caches, lazy initialisation
    for _ in range(repeats):
        for t in timers:
            t.run()
    return [t.result() for t in timers]


class _Timer:
    """Runs of one module on one input with the actors' stage code, timed."""

    def __init__(self, module: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Optional[Callable]) -> None:
        self.module, self.inputs, self.targets, self.loss_fn = module, inputs, targets, loss_fn
        device = _device_of(module, inputs)
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.times: dict[str, list[float]] = {"f": [], "b": [], "w": [], "full": []}
        self.seed_bytes = 0
        self.act_bytes, self.out_bytes, self.output = _held_bytes(module, inputs, targets, loss_fn)
        self.in_bytes = sum(t.numel() * t.element_size() for t in flatten(inputs)[1])

    def _forward(self) -> Slot:
        slot = _slot(self.inputs)
        forward(self.module, slot, self.targets, self.loss_fn, 1.0)
        if slot.loss is None:
            slot.grad_out = [torch.ones_like(t) for t in slot.out_float]
        return slot

    def run(self, record: bool = True) -> None:
        """``F, I, W`` then ``F, B``; gradients accumulate across runs, as across microbatches."""
        clock = time.perf_counter
        self.sync()
        t0 = clock()
        slot = self._forward()
        self.sync()
        t1 = clock()
        backward_input(self.module, slot)
        self.sync()
        t2 = clock()
        self.seed_bytes = sum(g.numel() * g.element_size() for _, grads, _ in slot.weight_seeds or ()
                              for g in grads if g is not None)
        backward_weight(self.module, slot)
        self.sync()
        t3 = clock()
        slot = self._forward()
        self.sync()
        t4 = clock()
        backward_full(slot)
        self.sync()
        t5 = clock()
        if record:
            for key, dt in (("f", t1 - t0), ("b", t2 - t1), ("w", t3 - t2), ("f", t4 - t3), ("full", t5 - t4)):
                self.times[key].append(dt)

    def result(self) -> Measurement:
        self.module.zero_grad(set_to_none=True)
        med = {k: statistics.median(v) for k, v in self.times.items()}
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return Measurement(f=med["f"], b=med["b"], w=med["w"], full=med["full"], act_bytes=self.act_bytes,
                           out_bytes=self.out_bytes, param_bytes=params, output=self.output,
                           seed_bytes=self.seed_bytes, in_bytes=self.in_bytes)


def _slot(inputs: Any) -> Slot:
    x, leaves = detach_for_next(inputs, requires_grad=True)
    return Slot(inp=x, inp_grad=leaves)


def _held_bytes(module, inputs, targets, loss_fn) -> tuple[int, int, Any]:
    """Bytes a microbatch keeps alive until its backward; the output bytes; the output."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    held: dict[int, int] = {}

    def keep(t: torch.Tensor) -> None:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            held[st.data_ptr()] = st.nbytes()

    def pack(t):
        keep(t)
        return t

    slot = _slot(inputs)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward(module, slot, targets, loss_fn, 1.0)
    _, ins = flatten(slot.inp)
    _, outs = flatten(slot.out)
    for t in ins + outs:
        keep(t)
    out_bytes = sum(t.numel() * t.element_size() for t in slot.out_float)
    output, _ = detach_for_next(slot.out, requires_grad=False)
    return sum(held.values()), out_bytes, output


def _device_of(module: torch.nn.Module, inputs: Any) -> torch.device:
    for p in module.parameters():
        return p.device
    _, tensors = flatten(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def time_rows(module: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Optional[Callable],
              sizes: Sequence[int], repeats: int) -> list[tuple[int, float, float, float, float]]:
    """``module`` timed on the first ``rows`` rows of ``inputs`` (and ``targets``) for each of
    ``sizes``, ``(rows, f, b, w, full)`` each; ``inputs`` hold the largest size.  Its
    gradients and buffers (running statistics) are left as they were."""
    grads = {p: p.grad for p in module.parameters()}
    buffers = {name: b.clone() for name, b in module.named_buffers()}
    for p in grads:
        p.grad = None
    try:
        points = []
        for rows in sorted(sizes):
            m = measure_chain([module], _first_rows(inputs, rows), loss_fn=loss_fn, repeats=repeats,
                              targets=_first_rows(targets, rows) if targets is not None else None)[0]
            points.append((rows, m.f, m.b, m.w, m.full))
        return points
    finally:
        for p, g in grads.items():
            p.grad = g
        with torch.no_grad():
            for name, b in module.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])


def _first_rows(value: Any, rows: int) -> Any:
    """``value`` cut to its first ``rows`` rows: every tensor whose leading dimension is the
    largest leading dimension in ``value`` (the batch's)."""
    spec, tensors = flatten(value)
    full = max((t.shape[0] for t in tensors if t.dim()), default=0)
    return unflatten(spec, [t[:rows] if t.dim() and t.shape[0] == full else t for t in tensors])
