"""Measuring stage modules on the controller: per-microbatch forward, backward (fused and
split into input and weight gradient) times and activation bytes, with the actors' own
stage code (``actors.timing`` on ``actors.stage_exec``), so ``split(balance="time")`` and
``schedule="auto"`` see what the actors will run."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Callable, Optional, Sequence

import torch

from actors.timing import Measurement, measure_chain
from actors.values import flatten, unflatten

__all__ = ["Measurement", "measure_module", "measure_chain", "measure_stages", "measure_built_stages", "measuring",
           "DEFAULT_BYTES_PER_S", "DEFAULT_LATENCY_S"]

# Point-to-point transfer model, per device kind: a hop costs latency + bytes / bandwidth.
# Documented constants, not measured per run: gloo over loopback TCP (pipe.profile's
# median receive latency was 0.6-0.8 ms between two actors on a busy 2-vCPU VM) and
# NCCL over NVLink/PCIe (order of magnitude).  choose_schedule and split take others.
DEFAULT_BYTES_PER_S = {"cpu": 1.0e9, "cuda": 2.0e10}
DEFAULT_LATENCY_S = {"cpu": 5.0e-4, "cuda": 2.0e-5}


def measure_module(module: torch.nn.Module, inputs: Any, *, targets: Any = None, loss_fn: Optional[Callable] = None,
                   repeats: int = 5) -> Measurement:
    """Time ``module`` (in place: gradients are cleared afterwards) on ``inputs``.

    With ``loss_fn`` and ``targets`` the loss is part of the forward (a last stage);
    otherwise the backward starts from a gradient of ones on every floating-point output.
    One warm-up, then ``repeats`` timed runs of ``F, I, W`` and of ``F, B``; medians.
    """
    return measure_chain([module], inputs, targets=targets, loss_fn=loss_fn, repeats=repeats)[0]


def measure_stages(stages: Sequence[torch.nn.Module], inputs: Any, *, targets: Any = None,
                   loss_fn: Optional[Callable] = None, repeats: int = 5, device: str = "cpu",
                   threads: Optional[int] = None) -> list[Measurement]:
    """Measure each stage on the previous stage's output, starting from ``inputs``.

    Runs on copies of the stages moved to ``device`` (the user's modules, their
    gradients and the random state are left as they were; the copies take the model's
    memory once more while measuring).  On CPU, ``threads`` sets torch's thread count
    during the measurement (an actor's ``num_cpus``).
    """
    dev = torch.device(device)
    with measuring(dev, threads):
        copies = [copy.deepcopy(stage).to(dev).train() for stage in stages]
        return measure_chain(copies, _to(inputs, dev), targets=_to(targets, dev), loss_fn=loss_fn, repeats=repeats)


def measure_built_stages(build: Callable[[int, torch.device], torch.nn.Module], num_stages: int,
                         inputs: Sequence[Any], *, targets: Optional[Sequence[Any]] = None,
                         loss_fn: Optional[Callable] = None, repeats: int = 5, device: str = "cpu",
                         threads: Optional[int] = None) -> list[list[Measurement]]:
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
                                  loss_fn=loss_fn if last else None, repeats=repeats)[0]
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


def _to(value: Any, device: torch.device) -> Any:
    if value is None:
        return None
    spec, tensors = flatten(value)
    return unflatten(spec, [t.to(device) for t in tensors])


