"""TeraPipe: token-level pipelining of a causal transformer (Li et al., ICML 2021).

A long sequence cannot be cut into enough microbatches to fill a pipeline, so each
(micro)batch of sequences is cut along the *token* axis into slices that flow through
the stages one after another: stage k runs slice i while stage k-1 runs slice i+1.
The unit of work is (microbatch b, slice i), the schedule's "microbatch" ``b*S + i``
(``schedules.token_sliced``); a ``GPTStage`` keeps the keys/values of a sequence's
earlier slices and back-propagates their gradient (Note [token-sliced context
gradients] in ``mpmd/models.py``).

    pipe = mpmd.Pipeline(mpmd.models.gpt_stages(cfg, 4), schedule="terapipe",
                         token_slices="auto", num_microbatches=1, loss_fn=mpmd.models.lm_loss, ...)
    pipe.token_slices      # e.g. (320, 192, 160, 128, 128, 96)
    loss = pipe.step(tokens, next_tokens)     # (batch, seq_len) each

``token_slices``: ``"auto"`` measures one slice's time over a few (length, context)
points on this process's device (on CPU with an actor's thread count, ``num_cpus``),
fits ``schedules.terapipe.CostModel`` and solves ``schedules.terapipe.plan_slices``;
an int gives that many near-equal slices; a list gives the slice lengths; a callable
``cost(length, context) -> seconds`` is planned with directly.  The measurement sees
compute only: ``slice_overhead=`` seconds adds the runtime's per-slice transfer and
dispatch cost to every slice (it matters on CPU/gloo, where a hop costs about as much
as a small slice's compute).  ``slice_granularity`` (default: the smallest divisor of
``seq_len`` giving at most 32 units) is the multiple every planned slice length is.
After construction ``pipe.token_slices``, ``pipe.slice_plan`` (predicted time) and
``pipe.slice_cost`` (the cost function planned with) say what was chosen.

``schedule`` picks the order of units: ``"terapipe"`` (= ``"gpipe"``, the paper's) or
``"terapipe-1f1b"`` (= ``"1f1b"``).  One stage per actor; ``dp`` replicas work as usual.

The loss is the token mean: ``loss_fn`` must be a mean over the tokens it is given
(like ``mpmd.models.lm_loss``); each slice's loss is weighted by its share of the
sequence, so the step's loss and gradients equal unsliced training of the same model.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable, Optional, Sequence, Union

import torch

from schedules.terapipe import CostModel, SlicePlan, plan_slices, uniform_slices
from schedules.token_sliced import token_sliced_schedule

from ._data import concat_outputs, split_batch
from .models import Embedding, token_slice
from .pipeline import Pipeline
from actors.values import flatten, unflatten

__all__ = ["TokenSlicedPipeline", "SliceLoss", "measure_slice_costs", "fit_slice_cost", "resolve_token_slices",
           "default_granularity", "ORDERS"]

# schedule name -> order of units (schedules.token_sliced.token_sliced_schedule)
ORDERS = {"terapipe": "gpipe", "gpipe": "gpipe", "terapipe-1f1b": "1f1b", "1f1b": "1f1b"}

TokenSlices = Union[str, int, Sequence[int], Callable[[int, int], float]]


def wants_token_slicing(args: tuple, kwargs: dict) -> bool:
    """Whether ``mpmd.Pipeline(*args, **kwargs)`` asks for token slicing (``Pipeline.__new__``)."""
    schedule = args[1] if len(args) > 1 else kwargs.get("schedule")
    return kwargs.get("token_slices") is not None or schedule in ("terapipe", "terapipe-1f1b")


class SliceLoss:
    """``loss_fn`` (a mean over the slice's tokens) times the slice's weight ``S * l / L``,
    so the runtime's ``1 / (M * S)`` scaling sums the slices to the sequence's token mean."""

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn

    def __call__(self, out: torch.Tensor, target: dict) -> torch.Tensor:
        return self.loss_fn(out, target["y"]) * target["w"].to(out.dtype)


class TokenSlicedPipeline(Pipeline):
    """``mpmd.Pipeline`` over token slices; ``mpmd.Pipeline(..., schedule="terapipe")`` or
    ``mpmd.Pipeline(..., token_slices=...)`` builds one.  See the module docstring."""

    def __init__(
        self,
        stages: Sequence[torch.nn.Module],
        schedule: str = "terapipe",
        num_microbatches: int = 1,
        loss_fn: Optional[Callable] = None,
        optimizer: Optional[Callable] = None,
        *,
        token_slices: Optional[TokenSlices] = "auto",
        seq_len: Optional[int] = None,
        slice_granularity: Optional[int] = None,
        slice_overhead: float = 0.0,
        **options: Any,
    ) -> None:
        stages = _check_sliced_stages(stages)
        if not isinstance(schedule, str) or schedule not in ORDERS:
            raise ValueError(f"token-sliced training takes schedule= one of {', '.join(ORDERS)}, got {schedule!r}")
        if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
            raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
        num_actors = options.get("num_actors")
        if num_actors is not None and num_actors != len(stages):
            raise ValueError(f"token-sliced training puts one stage on each actor: num_actors={num_actors} but "
                             f"{len(stages)} stages were given; pass num_actors={len(stages)} or omit it")
        token_slices = "auto" if token_slices is None else token_slices
        device = "cuda" if options.get("device", "auto") != "cpu" and torch.cuda.is_available() else "cpu"
        self.token_slices, self.slice_plan, self.slice_cost = resolve_token_slices(
            token_slices, stages, seq_len=seq_len, granularity=slice_granularity, device=device,
            num_threads=max(1, int(options.get("num_cpus", 1))), slice_overhead=slice_overhead)
        self.seq_len = sum(self.token_slices)
        self.num_sequence_microbatches = num_microbatches
        num_slices = len(self.token_slices)
        sched = token_sliced_schedule(len(stages), num_microbatches, num_slices, ORDERS[schedule])
        if len(set(self.token_slices)) > 1:
            options["dynamic_shapes"] = True  # units differ in shape: every transfer announces its shape
        super().__init__(stages, sched, num_microbatches=num_microbatches * num_slices,
                         loss_fn=SliceLoss(loss_fn) if loss_fn is not None else None, optimizer=optimizer, **options)

    # -- hooks of Pipeline._run ----------------------------------------------------------------
    def _microbatches(self, inputs: Any, targets: Any, parts: int, hint: str) -> tuple[list, Optional[list]]:
        chunks = parts // len(self.token_slices)
        hint = f"num_microbatches={self.num_sequence_microbatches} x dp={self.config.dp}"
        mb_in = [u for b, x in enumerate(split_batch(inputs, chunks, "inputs", hint))
                 for u in self._slice(x, b, "inputs")]
        mb_tg = None
        if targets is not None:
            mb_tg = [u for b, y in enumerate(split_batch(targets, chunks, "targets", hint))
                     for u in self._slice(y, b, "targets")]
        return mb_in, mb_tg

    def _slice(self, value: Any, seq: int, what: str) -> list:
        if not isinstance(value, torch.Tensor) or value.dim() < 2 or value.shape[1] != self.seq_len:
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"token-sliced {what} must be one tensor (batch, {self.seq_len}) for slices "
                             f"{list(self.token_slices)}, got {shape}; pass sequences of exactly "
                             f"{self.seq_len} tokens")
        out, pos, n = [], 0, len(self.token_slices)
        for length in self.token_slices:
            piece = value[:, pos:pos + length]
            if what == "inputs":
                out.append(token_slice(piece, seq, pos))
            else:
                out.append({"y": piece, "w": torch.tensor(n * length / self.seq_len, dtype=torch.float32)})
            pos += length
        return out

    def _join_outputs(self, outputs: list) -> Any:
        n = len(self.token_slices)
        spec, _ = flatten(outputs[0], where="stage output")
        sequences = []
        for k in range(0, len(outputs), n):
            flats = [flatten(o)[1] for o in outputs[k:k + n]]
            sequences.append(unflatten(spec, [torch.cat(ts, dim=1) for ts in zip(*flats)]))
        return concat_outputs(sequences)


def _check_sliced_stages(stages) -> list[torch.nn.Module]:
    stages = list(stages) if not isinstance(stages, torch.nn.Module) else [stages]
    for i, s in enumerate(stages):
        if not getattr(s, "supports_token_slices", False):
            raise ValueError(f"stages[{i}] ({type(s).__name__}) cannot run token slices; token-sliced training "
                             "(schedule='terapipe') needs stages that keep a sequence's key/value context, "
                             "e.g. mpmd.models.gpt_stages(cfg, num_stages)")
    if not stages:
        raise ValueError("stages is empty: pass a list of nn.Module, one per pipeline stage")
    return stages


def _model_seq_len(stages: Sequence[torch.nn.Module]) -> Optional[int]:
    for m in stages[0].modules():
        if isinstance(m, Embedding):
            return m.pos.num_embeddings
    return None


def default_granularity(seq_len: int, max_units: int = 32) -> int:
    """The smallest divisor ``g`` of ``seq_len`` with at most ``max_units`` slices of ``g`` tokens."""
    return next(g for g in range(1, seq_len + 1) if seq_len % g == 0 and seq_len // g <= max_units)


def resolve_token_slices(token_slices: TokenSlices, stages: Sequence[torch.nn.Module], *,
                         seq_len: Optional[int] = None, granularity: Optional[int] = None,
                         device: str = "cpu", num_threads: Optional[int] = 1,
                         slice_overhead: float = 0.0
                         ) -> tuple[tuple[int, ...], Optional[SlicePlan], Optional[Callable]]:
    """Slice lengths for ``token_slices``; returns (slices, plan or None, cost function or None).

    ``slice_overhead`` (seconds) is added to every slice's planned cost: the runtime's
    per-slice transfers and dispatch, which the in-process measurement does not see.
    """
    if not isinstance(slice_overhead, (int, float)) or not 0 <= slice_overhead < float("inf"):
        raise ValueError(f"slice_overhead must be a finite number of seconds >= 0, got {slice_overhead!r}")
    if isinstance(token_slices, (list, tuple)):
        bad = [x for x in token_slices if not isinstance(x, int) or isinstance(x, bool) or x < 1]
        if not token_slices or bad:
            raise ValueError(f"token_slices must be positive slice lengths, got {list(token_slices)!r}")
        if seq_len is not None and sum(token_slices) != seq_len:
            raise ValueError(f"token_slices {list(token_slices)} add up to {sum(token_slices)} tokens, "
                             f"but seq_len={seq_len}; make them add up to {seq_len}")
        return tuple(token_slices), None, None
    seq_len = seq_len if seq_len is not None else _model_seq_len(stages)
    if seq_len is None:
        raise ValueError("cannot tell the sequence length from the stages; pass seq_len=... "
                         "or token_slices as a list of slice lengths")
    g = granularity if granularity is not None else default_granularity(seq_len)
    if isinstance(token_slices, int) and not isinstance(token_slices, bool):
        return uniform_slices(seq_len, token_slices, g), None, None
    if token_slices == "auto":
        cost = fit_slice_cost(stages, seq_len, granularity=g, device=device, num_threads=num_threads)
    elif callable(token_slices):
        cost = token_slices
    else:
        raise ValueError(f"token_slices must be 'auto', a number of slices, a list of slice lengths or a "
                         f"cost(length, context) function, got {token_slices!r}")
    if slice_overhead:
        cost = _WithOverhead(cost, float(slice_overhead))
    plan = plan_slices(seq_len, len(stages), cost, g)
    return plan.slices, plan, cost


def fit_slice_cost(stages: Sequence[torch.nn.Module], seq_len: int, *, granularity: int = 1,
                   device: str = "cpu", repeats: int = 3,
                   num_threads: Optional[int] = 1) -> Callable[[int, int], float]:
    """Measure a stage's slice time on a grid of (length, context) points and fit the
    paper's ``a0 + a1*l + a2*c + a3*l*c``.

    Lengths run geometrically from one ``granularity`` unit to half the sequence, so the
    fixed per-slice cost ``a0`` (what stops the planner from cutting ever finer) is pinned
    by measurements of the smallest slices rather than extrapolated.  The fit is floored
    at the cheapest measured slice: no slice costs less than one unit without context.
    """
    g, units = granularity, seq_len // granularity
    lengths, n = [], 1
    while n <= max(1, units // 2):
        lengths.append(n * g)
        n *= 2
    contexts = sorted({round(units * f) * g for f in (0, 1 / 4, 1 / 2, 3 / 4)})
    points = [(l, c) for l in lengths for c in contexts if l + c <= seq_len]
    samples = measure_slice_costs(stages, points, device=device, repeats=repeats, num_threads=num_threads)
    return _Clamped(CostModel.fit(samples), max(min(t for _, _, t in samples), 1e-12))


class _WithOverhead:
    def __init__(self, cost: Callable[[int, int], float], overhead: float) -> None:
        self.cost, self.overhead = cost, overhead

    def __call__(self, length: int, context: int) -> float:
        return self.cost(length, context) + self.overhead

    def __repr__(self) -> str:
        return f"{self.cost!r} + {self.overhead:.3g}"


class _Clamped:
    def __init__(self, model: CostModel, floor: float) -> None:
        self.model, self.floor = model, floor

    def __call__(self, length: int, context: int) -> float:
        return max(self.model(length, context), self.floor)

    def __repr__(self) -> str:
        return f"max({self.model!r}, {self.floor:.3g})"


def measure_slice_costs(stages: Sequence[torch.nn.Module], points: Sequence[tuple[int, int]], *,
                        device: str = "cpu", repeats: int = 3, batch: int = 1,
                        num_threads: Optional[int] = 1) -> list[tuple[int, int, float]]:
    """``(length, context, seconds)``: forward plus backward of one slice of ``length`` tokens
    after ``context`` tokens, on the slowest stage (fastest of ``repeats``).  On CPU it runs
    with ``num_threads`` threads, as an actor with that many CPUs does (Ray sets
    ``OMP_NUM_THREADS`` to an actor's ``num_cpus``)."""
    threads = torch.get_num_threads()
    if device == "cpu" and num_threads:
        torch.set_num_threads(num_threads)
    try:
        return _measure(stages, points, torch.device(device), repeats, batch)
    finally:
        torch.set_num_threads(threads)


def _measure(stages, points, dev: torch.device, repeats: int, batch: int) -> list[tuple[int, int, float]]:
    copies = [copy.deepcopy(s).to(dev) for s in stages]
    vocab = next(m.tok.num_embeddings for m in copies[0].modules() if isinstance(m, Embedding))
    gen = torch.Generator().manual_seed(0)
    out = []
    for length, context in points:
        ids = torch.randint(0, vocab, (batch, context + length), generator=gen).to(dev)
        times = [_time_slice(copies, ids, context, dev) for _ in range(repeats + 1)][1:]  # first is warm-up
        per_stage = [min(t[s] for t in times) for s in range(len(copies))]  # load only adds time
        out.append((length, context, max(per_stage)))
    for s in copies:
        s.reset_contexts()
    return out


def _time_slice(stages: list, ids: torch.Tensor, context: int, dev: torch.device) -> list[float]:
    for s in stages:
        s.reset_contexts()
    if context:
        value: Any = token_slice(ids[:, :context], 0, 0)
        for s in stages:
            value = _detached(s(value))
    value = token_slice(ids[:, context:], 0, context)
    value = {k: v.to(dev) for k, v in value.items()}
    elapsed = []
    for s in stages:
        t0 = _now(dev)
        out = s(value)
        y = out["x"] if isinstance(out, dict) else out
        torch.autograd.backward([y], [torch.ones_like(y)])
        elapsed.append(_now(dev) - t0)
        value = _detached(out)
    return elapsed


def _detached(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: (v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v)
                for k, v in value.items()}
    return value.detach()


def _now(dev: torch.device) -> float:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()
