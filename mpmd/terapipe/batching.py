"""Token-sliced training as a batching strategy of the engine (TeraPipe).

``TokenSlicing`` is what ``mpmd.Pipeline(..., schedule="terapipe", token_slices=...)``
composes with the runtime: its schedule (units ``b * S + i`` of ``M`` sequences' ``S``
slices, ``schedules.token_sliced``), its split of a step's batch into those units, its
join of the units' outputs back into sequences, and the loss wrapping that weights each
slice by its share of the sequence, so the step's loss and gradients equal unsliced
training of the same model.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import torch

from actors.values import flatten, unflatten
from schedules import Schedule
from schedules.slicing import SlicePlan
from schedules.token_sliced import TOKEN_SLICED_NAMES, token_sliced_schedule

from ..runtime.batches import concat_outputs, split_batch
from .costs import TokenSlices, default_granularity, resolve_token_slices
from .protocol import supports_token_slices, token_slice

__all__ = ["TokenSlicing", "SliceLoss", "ORDERS", "wants_token_slicing", "plan_token_slicing"]

# schedule name -> order of units (schedules.token_sliced.token_sliced_schedule)
ORDERS = {"terapipe": "gpipe", "gpipe": "gpipe", "terapipe-1f1b": "1f1b", "1f1b": "1f1b"}
_NAMES = {"gpipe": "terapipe", "1f1b": "terapipe-1f1b"}


def wants_token_slicing(schedule: Any, token_slices: Any) -> bool:
    """Whether ``mpmd.Pipeline(schedule=..., token_slices=...)`` asks for token-sliced training."""
    return token_slices is not None or (isinstance(schedule, str) and schedule in TOKEN_SLICED_NAMES)


class SliceLoss:
    """``loss_fn`` (a mean over the slice's tokens) times the slice's weight ``S * l / L``,
    so the runtime's ``1 / (M * S)`` scaling sums the slices to the sequence's token mean."""

    def __init__(self, loss_fn: Callable) -> None:
        self.loss_fn = loss_fn

    def __call__(self, out: torch.Tensor, target: dict) -> torch.Tensor:
        return self.loss_fn(out, target["y"]) * target["w"].to(out.dtype)


@dataclasses.dataclass(frozen=True)
class TokenSlicing:
    """``num_microbatches`` sequences per step and replica, each cut into ``slices`` (token
    counts) that run in ``order`` ("gpipe": TeraPipe's; "1f1b").  ``plan`` and ``cost``: the
    planned slicing and the cost function it was planned with (``token_slices="auto"`` or
    a cost function), else None.  ``granularity``: the multiple planned slice lengths are.
    ``calibrate``: the plan is provisional, to be measured on the actors and made again
    (``calibrate.py``); ``step_model``: what that measured (then ``plan.total_time`` is its
    predicted step time)."""

    slices: tuple[int, ...]
    num_microbatches: int
    order: str = "gpipe"
    plan: Optional[SlicePlan] = None
    cost: Optional[Callable[[int, int], float]] = None
    granularity: int = 1
    calibrate: bool = False
    step_model: Optional[Any] = None  # calibrate.SliceStepModel

    @property
    def seq_len(self) -> int:
        return sum(self.slices)

    @property
    def num_units(self) -> int:
        """The schedule's microbatches: sequences x slices."""
        return self.num_microbatches * len(self.slices)

    @property
    def varies(self) -> bool:
        """Whether units differ in shape (every transfer then announces its shape)."""
        return len(set(self.slices)) > 1

    def schedule(self, num_ranks: int) -> Schedule:
        return token_sliced_schedule(num_ranks, self.num_microbatches, len(self.slices), self.order)

    def wrap_loss(self, loss_fn: Optional[Callable]) -> Optional[Callable]:
        return SliceLoss(loss_fn) if loss_fn is not None else None

    # -- the Batching strategy (mpmd/runtime/batches.py) ------------------------------------------
    def split(self, inputs: Any, targets: Any, parts: int, hint: str) -> tuple[list, Optional[list]]:
        chunks = parts // len(self.slices)
        hint = f"num_microbatches={self.num_microbatches} x dp={chunks // self.num_microbatches}"
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
                             f"{list(self.slices)}, got {shape}; pass sequences of exactly {self.seq_len} tokens")
        out, pos, n = [], 0, len(self.slices)
        for length in self.slices:
            piece = value[:, pos:pos + length]
            if what == "inputs":
                out.append(token_slice(piece, seq, pos))
            else:
                out.append({"y": piece, "w": torch.tensor(n * length / self.seq_len, dtype=torch.float32)})
            pos += length
        return out

    def join(self, outputs: list) -> Any:
        n = len(self.slices)
        spec, _ = flatten(outputs[0], where="stage output")
        sequences = []
        for k in range(0, len(outputs), n):
            flats = [flatten(o)[1] for o in outputs[k:k + n]]
            sequences.append(unflatten(spec, [torch.cat(ts, dim=1) for ts in zip(*flats)]))
        return concat_outputs(sequences)

    def checkpoint_options(self) -> dict:
        return {"schedule": _NAMES[self.order], "num_microbatches": self.num_microbatches,
                "token_slices": list(self.slices)}


def plan_token_slicing(stages: Sequence[torch.nn.Module], schedule: str, num_microbatches: Any, *,
                       token_slices: Optional[TokenSlices], seq_len: Optional[int] = None,
                       slice_granularity: Optional[int] = None, slice_overhead: Optional[float] = None,
                       pp: Optional[int] = None, device: str = "auto", num_cpus: float = 1.0) -> TokenSlicing:
    """Check token-sliced training's arguments and choose the slices (``token_slices``:
    ``"auto"`` when None; see ``mpmd.terapipe.costs``).  ``"auto"`` without ``slice_overhead``
    gives a provisional plan, ``calibrate=True``: the pipeline measures it on its actors."""
    stages = _check_sliced_stages(stages)
    if not isinstance(schedule, str) or schedule not in ORDERS:
        raise ValueError(f"token-sliced training takes schedule= one of {', '.join(ORDERS)}, got {schedule!r}")
    if not isinstance(num_microbatches, int) or isinstance(num_microbatches, bool) or num_microbatches < 1:
        raise ValueError(f"num_microbatches must be a positive integer, got {num_microbatches!r}")
    if pp is not None and pp != len(stages):
        raise ValueError(f"token-sliced training puts one stage on each actor: num_actors={pp} but "
                         f"{len(stages)} stages were given; pass num_actors={len(stages)} or omit it")
    where = "cuda" if device != "cpu" and torch.cuda.is_available() else "cpu"
    token_slices = "auto" if token_slices is None else token_slices
    slices, plan, cost = resolve_token_slices(
        token_slices, stages, seq_len=seq_len, granularity=slice_granularity,
        device=where, num_threads=max(1, int(num_cpus)), slice_overhead=slice_overhead)
    auto = isinstance(token_slices, str) and token_slices == "auto"
    granularity = slice_granularity if slice_granularity is not None else default_granularity(sum(slices))
    return TokenSlicing(slices=slices, num_microbatches=num_microbatches, order=ORDERS[schedule], plan=plan,
                        cost=cost, granularity=granularity, calibrate=auto and slice_overhead is None)


def _check_sliced_stages(stages) -> list[torch.nn.Module]:
    stages = list(stages) if not isinstance(stages, torch.nn.Module) else [stages]
    for i, s in enumerate(stages):
        if not supports_token_slices(s):
            raise ValueError(f"stages[{i}] ({type(s).__name__}) cannot run token slices; token-sliced training "
                             "(schedule='terapipe') needs stages that keep a sequence's key/value context, "
                             "e.g. mpmd.models.gpt_stages(cfg, num_stages)")
    if not stages:
        raise ValueError("stages is empty: pass a list of nn.Module, one per pipeline stage")
    return stages
