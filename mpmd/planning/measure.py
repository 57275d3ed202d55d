"""Measuring stage modules on the controller: per-microbatch forward, backward (fused and
split into input and weight gradient) times and activation bytes, with the actors' own
stage code (``actors.stage_exec``), so ``split(balance="time")`` and ``schedule="auto"``
see what the actors will run."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch

from actors.stage_exec import Slot, backward_full, backward_input, backward_weight, detach_for_next, forward
from actors.values import flatten, unflatten

from .phases import phases_of

__all__ = ["Measurement", "measure_module", "measure_chain", "measure_stages", "measure_stages_each",
           "measure_built_stages", "measuring", "default_memory_limit",
           "DEFAULT_BYTES_PER_S", "DEFAULT_LATENCY_S"]

# Point-to-point transfer model, per device kind: a hop costs latency + bytes / bandwidth.
# Documented constants, not measured per run: gloo over loopback TCP (pipe.profile's
# median receive latency was 0.6-0.8 ms between two actors on a busy 2-vCPU VM) and
# NCCL over NVLink/PCIe (order of magnitude).  choose_schedule and split take others.
DEFAULT_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 2.0e10}
DEFAULT_LATENCY_S = {"cpu": 5.0e-4, "cuda": 2.0e-5}


@dataclasses.dataclass(frozen=True)
class Measurement:
    """Median seconds of one module on one microbatch, and its memory.

    ``b`` is the input-gradient backward (``I``), ``w`` the weight-gradient one (``W``),
    ``full`` a fused backward (``B``).  ``act_bytes`` is what the microbatch holds until
    its backward ends (saved tensors, input, output; parameters excluded);
    ``out_bytes`` the floating-point output sent on (and its gradient sent back);
    ``seed_bytes`` what a split backward holds from ``I`` to ``W`` besides the graph (the
    gradients ``W`` starts from, Note [weight seeds] in actors/split_backward.py).  The
    allocator's view of one microbatch (Note [memory phases] in phases.py): ``f_peak``, ``b_peak``,
    ``i_peak``, ``w_peak`` what each phase allocates on its way above what was live when it
    began and (for ``F``) above what it leaves; ``i_held`` what stays live from ``I`` to ``W``.
    The same, recomputed (Note [recomputed phases] in phases.py): ``r_held`` what a checkpointed forward
    keeps until ``B`` and ``rb_peak`` its ``B``'s peak; ``rs_held`` what a forward recomputed
    at ``I`` keeps until then, ``ri_peak``, ``ri_held`` and ``rw_peak`` its ``I`` and ``W``.
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
    f_peak: int = 0
    b_peak: int = 0
    i_peak: int = 0
    w_peak: int = 0
    i_held: int = 0
    r_held: int = 0
    rb_peak: int = 0
    rs_held: int = 0
    ri_peak: int = 0
    ri_held: int = 0
    rw_peak: int = 0


def measure_module(module: torch.nn.Module, inputs: Any, *, targets: Any = None, loss_fn: Optional[Callable] = None,
                   repeats: int = 5) -> Measurement:
    """Time ``module`` (in place: gradients are cleared afterwards) on ``inputs``.

    With ``loss_fn`` and ``targets`` the loss is part of the forward (a last stage);
    otherwise the backward starts from a gradient of ones on every floating-point output.
    One warm-up, then ``repeats`` timed runs of ``F, I, W`` and of ``F, B``; medians.
    """
    return measure_chain([module], inputs, targets=targets, loss_fn=loss_fn, repeats=repeats)[0]


def measure_chain(modules: Sequence[torch.nn.Module], inputs: Any, *, targets: Any = None,
                  loss_fn: Optional[Callable] = None, repeats: int = 5, autocast: Optional[tuple] = None,
                  ) -> list[Measurement]:
    """``measure_module`` for each module on the previous one's output (the loss on the last).

    The modules take turns, one run each per round, so a change in the machine's load
    during the measurement shifts every module alike instead of inflating one.
    ``autocast``: ``(device_type, dtype)``, the run's precision, as the actors run it.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    timers, value = [], inputs
    for i, module in enumerate(modules):
        last = i == len(modules) - 1
        timers.append(_Timer(module, value, targets if last else None, loss_fn if last else None, autocast))
        value = timers[-1].output
    for t in timers:
        t.run(record=False)  # warm-up: allocator, caches, lazy initialisation (and the gradients exist)
    for t in timers:
        t.memory_phases()
    for _ in range(repeats):
        for t in timers:
            t.run()
    return [t.result() for t in timers]


class _Timer:
    """Runs of one module on one input with the actors' stage code, timed."""

    def __init__(self, module: torch.nn.Module, inputs: Any, targets: Any, loss_fn: Optional[Callable],
                 autocast: Optional[tuple] = None) -> None:
        self.module, self.inputs, self.targets, self.loss_fn = module, inputs, targets, loss_fn
        # a stage without the loss hands its output on, in the autocast dtype (Note [precision boundary])
        self.how = dict(autocast=autocast, boundary=targets is None or loss_fn is None)
        device = _device_of(module, inputs)
        self.sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        self.times: dict[str, list[float]] = {"f": [], "b": [], "w": [], "full": []}
        self.seed_bytes = 0
        self.phases: dict = {}  # the profiled phases' times, when profiled (phases_of)
        self.act_bytes, self.out_bytes, self.output = _held_bytes(module, inputs, targets, loss_fn, self.how)
        self.in_bytes = sum(t.numel() * t.element_size() for t in flatten(inputs)[1])
        self.phases: dict = {}  # Measurement's per-phase fields, once the phases are profiled

    def _forward(self, seed: bool = True, **recompute) -> Slot:
        slot = _slot(self.inputs)
        forward(self.module, slot, self.targets, self.loss_fn, 1.0, **self.how, **recompute)
        if seed:
            self._seed(slot)
        return slot

    @staticmethod
    def _seed(slot: Slot) -> None:
        """The output's gradient, as the next stage sends it back (none on a last stage)."""
        if slot.loss is None:
            slot.grad_out = [torch.ones_like(t) for t in slot.out_float]

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

    def memory_phases(self) -> None:
        """One microbatch's ``F, I, W`` and ``F, B`` under the profiler's allocation events
        (Note [memory phases] in phases.py)."""
        from torch.profiler import ProfilerActivity, profile, record_function

        device = _device_of(self.module, self.inputs)
        kinds = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.sync()

        def phase(name: str, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:  # marked, device work in
            with record_function(f"mpmd::{name}"):
                out = run(*args, **kwargs)
                self.sync()
            return out

        with profile(activities=kinds, profile_memory=True) as prof:
            slot = phase("F", self._forward)
            phase("I", backward_input, self.module, slot)
            phase("W", backward_weight, self.module, slot)
            del slot
            slot = phase("F2", self._forward)
            phase("B", backward_full, slot)
            del slot
            # Note [recomputed phases]: checkpointed (F, B), then recomputed at I (F, I, W)
            slot = phase("RF", self._forward, seed=False, recompute=True)
            self._seed(slot)  # received just before B on an actor: not part of what F keeps
            phase("RB", backward_full, slot)
            del slot
            slot = phase("RS", self._forward, seed=False, recompute=True, split=True)
            self._seed(slot)
            phase("RI", backward_input, self.module, slot)
            phase("RW", backward_weight, self.module, slot)
            del slot
        self.phases = phases_of(prof.profiler.kineto_results.events(), device.type.upper())

    def result(self) -> Measurement:
        self.module.zero_grad(set_to_none=True)
        med = {k: statistics.median(v) for k, v in self.times.items()}
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        return Measurement(f=med["f"], b=med["b"], w=med["w"], full=med["full"], act_bytes=self.act_bytes,
                           out_bytes=self.out_bytes, param_bytes=params, output=self.output,
                           seed_bytes=self.seed_bytes, in_bytes=self.in_bytes, **self.phases)


def measure_stages(stages: Sequence[torch.nn.Module], inputs: Any, *, targets: Any = None,
                   loss_fn: Optional[Callable] = None, repeats: int = 5, device: str = "cpu",
                   threads: Optional[int] = None) -> list[Measurement]:
    """Measure each stage on the previous stage's output, starting from ``inputs``.

    Runs on copies of the stages moved to ``device`` (the user's modules, their
    gradients and the random state are left as they were; the copies take the model's
    memory once more while measuring).  On CPU, ``threads`` sets torch's thread count
    during the measurement (an actor's ``num_cpus``).
    """
    return measure_stages_each(stages, [(inputs, targets)], loss_fn=loss_fn, repeats=repeats, device=device,
                               threads=threads)[0]


def measure_stages_each(stages: Sequence[torch.nn.Module], samples: Sequence[tuple[Any, Any]], *,
                        loss_fn: Optional[Callable] = None, repeats: int = 5, device: str = "cpu",
                        threads: Optional[int] = None, autocast: Optional[tuple] = None) -> list[list[Measurement]]:
    """``measure_stages`` on each ``(inputs, targets)`` of ``samples`` (one per microbatch
    size, say), on one copy of the stages: the model is copied once, not once a sample."""
    dev = torch.device(device)
    with measuring(dev, threads):
        copies = [copy.deepcopy(stage).to(dev).train() for stage in stages]
        return [measure_chain(copies, _to(x, dev), targets=_to(y, dev), loss_fn=loss_fn, repeats=repeats,
                              autocast=autocast) for x, y in samples]


def measure_built_stages(build: Callable[[int, torch.device], torch.nn.Module], num_stages: int,
                         inputs: Sequence[Any], *, targets: Optional[Sequence[Any]] = None,
                         loss_fn: Optional[Callable] = None, repeats: int = 5, device: str = "cpu",
                         threads: Optional[int] = None, autocast: Optional[tuple] = None) -> list[list[Measurement]]:
    """``measure_stages`` for stages built one at a time by ``build(s, device)``, per sample:
    stage ``s`` is built, measured on each of ``inputs`` (as the previous stage's output on
    it; ``targets`` aligned with ``inputs``) and freed before stage ``s + 1`` is built, so
    this process holds one stage at a time (Note [stage factories] in actors/build.py).
    Returns, per input, the stages' measurements."""
    dev = torch.device(device)
    values = [_to(x, dev) for x in inputs]
    goals = [_to(t, dev) for t in targets] if targets is not None else [None] * len(values)
    out: list[list[Measurement]] = [[] for _ in values]
    with measuring(dev, threads):
        for s in range(num_stages):
            last = s == num_stages - 1
            module = build(s, dev).train()
            for k, value in enumerate(values):
                m = measure_chain([module], value, targets=goals[k] if last else None,
                                  loss_fn=loss_fn if last else None, repeats=repeats, autocast=autocast)[0]
                out[k].append(m)
                values[k] = m.output
            del module
    return out


@contextlib.contextmanager
def measuring(device: torch.device, threads: Optional[int]):
    """While measuring on ``device``: ``threads`` torch threads on CPU, the random state restored after."""
    devices = [device.index if device.index is not None else torch.cuda.current_device()] \
        if device.type == "cuda" else []
    old = torch.get_num_threads()
    try:
        if device.type == "cpu" and threads:
            torch.set_num_threads(threads)
        with torch.random.fork_rng(devices=devices), torch.enable_grad():
            yield
    finally:
        torch.set_num_threads(old)


def _slot(inputs: Any) -> Slot:
    x, leaves = detach_for_next(inputs, requires_grad=True)
    return Slot(inp=x, inp_grad=leaves)


def _held_bytes(module, inputs, targets, loss_fn, how: dict) -> tuple[int, int, Any]:
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
        forward(module, slot, targets, loss_fn, 1.0, **how)
    _, ins = flatten(slot.inp)
    _, outs = flatten(slot.out)
    for t in ins + outs:
        keep(t)
    out_bytes = sum(t.numel() * t.element_size() for t in slot.out_float)
    output, _ = detach_for_next(slot.out, requires_grad=False)
    return sum(held.values()), out_bytes, output


def default_memory_limit(device: str) -> int:
    """What one actor's device has: the GPU's total memory, or the machine's RAM on CPU
    (actors sharing a machine share it; pass ``memory_limit_bytes`` to be exact)."""
    if device == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _device_of(module: torch.nn.Module, inputs: Any) -> torch.device:
    for p in module.parameters():
        return p.device
    _, tensors = flatten(inputs)
    return tensors[0].device if tensors else torch.device("cpu")


def _to(value: Any, device: torch.device) -> Any:
    if value is None:
        return None
    spec, tensors = flatten(value)
    return unflatten(spec, [t.to(device) for t in tensors])


