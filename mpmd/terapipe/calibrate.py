"""``token_slices="auto"`` measured where the job runs: the per-slice overhead on the actors.

The slice-cost model (``costs.py``) times a slice's compute in this process.  A slice on
the actors also costs its dispatch, its transfers over the real links and the wait for
them, which the compute model does not see and which, on CPU/gloo, is as large as a small
slice's compute (issue 20: the compute-only DP plan ran 1.19x faster than unsliced where
8 uniform slices ran 1.61x).  Note [calibrated slices]:

    step = model(slices) + (n + K - 1) * o + c

``model`` is the compute-only pipeline latency ``sum t_i + (K - 1) max t_i`` of the ``n``
slices on ``K`` stages, ``o`` the overhead of one slice (added to every slice's cost,
so a slice's pipeline hops add it ``n + K - 1`` times) and ``c`` the step's own cost
(the optimizer, dispatch).  ``o`` has two values: ``fixed`` when every slice has one
length, ``varying`` when they differ, because then every transfer first announces its
shapes in a header and no receive can be posted ahead (``dynamic_shapes``, Note
[receive prefetch] in actors/transfers.py).

``calibrate_token_slicing`` runs the provisional compute-only plan and three uniform
slicings (and a varying one, if the plan has one length) for a few training steps on
random token ids on the pipeline's own actors, back and forth (A B C C B A, so a load
that comes and goes on the machine falls on each alike), fits ``fixed``, ``varying``
and ``c`` by least squares (``fit_step_model``) and plans again (``choose_slices``: the
DP plan with ``varying`` against every uniform slicing with ``fixed``; the smallest
predicted step wins).  A choice not yet timed runs back and forth against the fastest
probe; the fastest slicing measured is kept (the model's choice unless a probe beat it:
a guard against a model that misses something, as the compute-only one did).  The
actors are set up again from the stages' first state to run it (``Engine.reschedule``),
their RNG states put back: training starts as if no probe had run, so it equals
single-process training as before.  It prints one line: the overheads, the times
measured, the slicing chosen and its predicted step time (``pipe.token_slicing.step_model``
and ``.plan`` keep them).  ``slice_overhead=`` given skips all of this.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Sequence

import torch

from schedules.slicing import SlicePlan, plan_slices, slicing_time, uniform_slices

from .batching import TokenSlicing
from .costs import with_overhead
from .protocol import first_stage_attribute

__all__ = ["SliceStepModel", "fit_step_model", "choose_slices", "probe_slicings", "calibrate_token_slicing"]

Cost = Callable[[int, int], float]


@dataclasses.dataclass(frozen=True)
class SliceStepModel:
    """Note [calibrated slices]: a training step's seconds for a slicing on ``num_stages``
    stages: the compute-only ``cost`` model, plus ``fixed`` (slices of one length) or
    ``varying`` seconds per slice and hop, plus ``per_step``.  ``measured``: the
    ``(slices, seconds)`` it was fitted to."""

    cost: Cost
    num_stages: int
    fixed: float
    varying: float
    per_step: float
    measured: tuple[tuple[tuple[int, ...], float], ...] = ()

    def overhead(self, slices: Sequence[int]) -> float:
        return self.varying if len(set(slices)) > 1 else self.fixed

    def __call__(self, slices: Sequence[int]) -> float:
        """The predicted step time of ``slices``, seconds."""
        return slicing_time(slices, self.num_stages, with_overhead(self.cost, self.overhead(slices))) + self.per_step

    def __str__(self) -> str:
        return (f"per-slice overhead {self.fixed * 1e3:.2f} ms (slices of one length), {self.varying * 1e3:.2f} ms "
                f"(varying lengths), {self.per_step * 1e3:.1f} ms per step")


def fit_step_model(measured: Sequence[tuple[Sequence[int], float]], num_stages: int, cost: Cost) -> SliceStepModel:
    """Least-squares ``fixed``, ``varying`` and ``per_step`` from measured ``(slices, seconds)``
    steps (Note [calibrated slices]).  An overhead no slicing measured takes the other's
    value; a term fitted below 0 (noise) is held at 0 and the others fitted again."""
    if len(measured) < 2:
        raise ValueError(f"fitting the per-slice overhead needs at least 2 measured slicings, got {len(measured)}")
    rows = []
    for slices, seconds in measured:
        if not slices or not seconds > 0:
            raise ValueError(f"a measured step needs slices and a positive time, got {tuple(slices)}, {seconds!r}")
        hops = len(slices) + num_stages - 1
        varies = len(set(slices)) > 1
        rows.append((1.0, hops * (not varies), hops * varies, seconds - slicing_time(slices, num_stages, cost)))
    kinds = [0] + [k for k in (1, 2) if any(r[k] for r in rows)]  # per step, per slice of one length, varying
    free, got = list(kinds), {}
    while free:
        x = torch.tensor([[r[k] for k in free] for r in rows], dtype=torch.float64)
        y = torch.tensor([[r[3]] for r in rows], dtype=torch.float64)
        got = dict(zip(free, torch.linalg.lstsq(x, y, driver="gelsd").solution.squeeze(1).tolist()))
        worst = min(free, key=got.__getitem__)
        if got[worst] >= 0:
            break
        free.remove(worst)  # a cost below 0 is noise: held at 0, the rest fitted again
        got = {}
    per_step, fixed, varying = (max(0.0, got.get(k, 0.0)) for k in (0, 1, 2))
    if 1 not in kinds:
        fixed = varying
    if 2 not in kinds:
        varying = fixed
    return SliceStepModel(cost, num_stages, fixed, varying, per_step,
                          tuple((tuple(s), float(t)) for s, t in measured))


def choose_slices(model: SliceStepModel, seq_len: int, granularity: int) -> SlicePlan:
    """The slicing ``model`` predicts fastest: TeraPipe's DP plan with ``model.varying`` per
    slice, or a uniform slicing (every divisor of the ``granularity`` units) with
    ``model.fixed``; ``total_time`` is the predicted step time."""
    units = seq_len // granularity
    dp = plan_slices(seq_len, model.num_stages, with_overhead(model.cost, model.varying), granularity).slices
    candidates = [dp] + [uniform_slices(seq_len, n, granularity) for n in range(1, units + 1) if units % n == 0]
    best = min(candidates, key=model)  # the DP plan first: it wins a tie
    return SlicePlan(total_time=model(best), slices=best)


def probe_slicings(slices: Sequence[int], num_stages: int, granularity: int) -> list[tuple[int, ...]]:
    """What to time: ``slices`` (the provisional plan), uniform slicings into about
    ``num_stages``, ``2 * num_stages`` and ``4 * num_stages`` slices, and, if none of those
    has slices of different lengths, ``slices`` with one unit moved from its last slice to
    its first."""
    seq_len, slices = sum(slices), tuple(slices)
    units = seq_len // granularity
    divisors = [n for n in range(1, units + 1) if units % n == 0]
    low = max(n for n in divisors if n <= num_stages)
    more = [min((n for n in divisors if n >= f * num_stages), default=divisors[-1]) for f in (2, 4)]
    out = [slices] + [u for u in (uniform_slices(seq_len, n, granularity) for n in [low] + more) if u != slices]
    if all(len(set(s)) == 1 for s in out):
        base = slices if len(slices) > 1 else uniform_slices(seq_len, min(2, units), granularity)
        if len(base) > 1 and base[-1] > granularity:
            out.append((base[0] + granularity,) + base[1:-1] + (base[-1] - granularity,))
    return list(dict.fromkeys(out))


def calibrate_token_slicing(engine, slicing: TokenSlicing, *, dynamic_shapes: bool = False,
                            steps: int = 3, warmup: int = 1) -> TokenSlicing:
    """Note [calibrated slices]: time ``probe_slicings`` on ``engine``'s actors, fit the step
    model, time its choice, and set the actors up again from the stages' first state to run
    the fastest measured; that slicing (``step_model`` and ``plan`` set).  The engine runs
    the provisional slicing; ``dynamic_shapes``: what the user asked.  Each slicing runs
    twice, ``steps`` timed after ``warmup`` each time, and counts its median.  On failure
    the engine is shut down."""
    try:
        return _calibrate(engine, slicing, dynamic_shapes, steps, warmup)
    except BaseException:
        engine.shutdown()
        raise


def _calibrate(engine, slicing: TokenSlicing, dynamic_shapes: bool, steps: int, warmup: int) -> TokenSlicing:
    vocab = first_stage_attribute(engine.stages, "vocab_size")
    units = slicing.seq_len // slicing.granularity
    if vocab is None or slicing.cost is None or units < 2 or engine.loss_fn is None:  # nothing to time or train
        return dataclasses.replace(slicing, calibrate=False)
    rng = engine.client.rng_states()
    gen = torch.Generator().manual_seed(0)
    batch = slicing.num_microbatches * engine.config.layout.dp
    tokens = torch.randint(0, vocab, (batch, slicing.seq_len + 1), generator=gen)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    num_stages = engine.num_ranks
    running = [slicing.slices]  # what the actors run now

    def measure(slicings: list[tuple[int, ...]]) -> list[tuple[tuple[int, ...], float]]:
        # Back and forth (A B C, C B A): a load that grows or fades on the machine meanwhile
        # falls on each alike.  The first steps after a switch are not timed (shapes learnt).
        times: dict[tuple[int, ...], list[float]] = {}
        for slices in slicings + slicings[::-1]:
            if slices != running[0]:
                _run(engine, dataclasses.replace(slicing, slices=slices), dynamic_shapes)
                running[0] = slices
            for i in range(warmup + steps):
                t0 = time.perf_counter()
                engine.train_step(inputs, targets)
                if i >= warmup:
                    times.setdefault(slices, []).append(time.perf_counter() - t0)
        return [(s, statistics.median(times[s])) for s in slicings]

    try:
        measured = measure(probe_slicings(slicing.slices, num_stages, slicing.granularity))
    except Exception as e:  # a loss or stage that takes other targets than next tokens
        why = (f"token_slices='auto' times slicings on the actors with random token ids (0..{vocab - 1}) as inputs "
               f"and next-token targets, and a step failed: {e}. If the model or loss_fn needs other inputs, pass "
               f"slice_overhead=<seconds per slice> (no timing) or token_slices=<count or lengths>")
        try:
            wrapped = type(e)(why)
        except Exception:  # an error type that takes other arguments
            wrapped = RuntimeError(why)
        raise wrapped from e
    best = min(measured, key=lambda m: m[1])[0]
    proposed = choose_slices(fit_step_model(measured, num_stages, slicing.cost), slicing.seq_len, slicing.granularity)
    if proposed.slices not in [s for s, _ in measured]:
        duel = measure([best, proposed.slices])  # the model's choice against the fastest probe, side by side
        measured += duel
        best = min(duel, key=lambda m: m[1])[0]  # the model's choice, unless the probe ran faster
    model = fit_step_model(measured, num_stages, slicing.cost)
    plan = SlicePlan(total_time=model(best), slices=best)
    chosen = dataclasses.replace(slicing, slices=best, plan=plan, calibrate=False, step_model=model)
    _run(engine, chosen, dynamic_shapes)  # from the stages' first state: the probes leave no trace
    engine.client.set_rng_states(rng)
    print(f"TeraPipe token_slices='auto' on {num_stages} actors: {model}; timed (ms): "
          + ", ".join(f"{_text(s)} {t * 1e3:.1f}" for s, t in measured)
          + f"; running {_text(best)}, predicted {plan.total_time * 1e3:.1f} ms a step", flush=True)
    return chosen


def _text(slices: Sequence[int]) -> str:
    return f"{len(slices)} x {slices[0]}" if len(set(slices)) == 1 else str(list(slices))


def _run(engine, slicing: TokenSlicing, dynamic_shapes: bool) -> None:
    schedule, config = slicing.schedule(engine.num_ranks), engine.config
    config = dataclasses.replace(config, comm=dataclasses.replace(config.comm,
                                                                  dynamic_shapes=dynamic_shapes or slicing.varies))
    engine.reschedule(schedule, config, slicing)
