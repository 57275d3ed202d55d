"""Cutting one model into pipeline stages: ``PipelineYield`` markers or a balance.

``split(model, ...)`` takes a model that is a sequence of layers (an ``nn.Sequential``,
an ``nn.ModuleList``, a list of modules, or a module whose children run in order) and
returns one ``nn.Sequential`` per stage.  The stages hold the model's own layer objects
(nothing is copied), so ``nn.Sequential(*stages)`` computes what ``model`` computes.
A Hugging Face causal LM is cut by ``hf.split_causal_lm`` instead (stages that build
their own masks and positions, under the model's own state-dict keys).

Balancing is a min-max partition of the layer sequence into contiguous stages
(``partition``): with ``balance="params"`` a layer weighs its parameter count; with
``balance="time"`` it weighs its measured forward + backward seconds on ``sample``, and
each stage also pays for the activations crossing its boundaries (Note [boundary
cost]).  With ``tp=T`` both weigh what one of a stage's ``T`` tensor-parallel ranks
carries (Note [TP balance]).
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn

from actors.values import flatten

from .hf_meta import is_on_meta, meta_factories
from .measure import DEFAULT_BYTES_PER_S, DEFAULT_LATENCY_S, measure_chain, measuring
from .tp import collective_seconds, per_rank_share, tp_profile

__all__ = ["PipelineYield", "split", "partition", "SplitStages", "BALANCE_MODES"]

log = logging.getLogger(__name__)

BALANCE_MODES = ("params", "time")


class PipelineYield(nn.Module):
    """Marks where a pipeline stage ends: put it between layers of an ``nn.Sequential``.

    Identity in ``forward``, so the marked model still runs (and trains) unsplit;
    ``mpmd.split`` cuts at every marker and drops the markers from the stages.
    """

    def forward(self, x: Any) -> Any:
        return x


class SplitStages(list):
    """The stage modules (a plain list of ``nn.Sequential``, or of ``hf.CausalLMStage`` for a
    Hugging Face model) plus what the split predicted.

    ``layer_counts`` per stage; ``param_counts`` per stage; ``predicted_s`` per stage
    (forward + backward seconds per sample microbatch with the boundary transfers, only
    for ``balance="time"``, else ``None``; per TP rank with ``tp > 1``); ``tp`` the
    tensor-parallel degree balanced for and ``rank_param_counts`` per stage the
    parameters one TP rank holds (Note [TP balance]); ``table`` the printed summary.
    """

    layer_counts: list[int]
    param_counts: list[int]
    rank_param_counts: list[float]
    tp: int
    predicted_s: Optional[list[float]]
    table: str


def split(model: Union[nn.Module, Sequence[nn.Module]], num_stages: Optional[int] = None,
          balance: Union[str, Sequence[int], None] = None, sample: Any = None, *, verbose: bool = True,
          repeats: int = 5, bytes_per_s: Optional[float] = None, loss_fn: Optional[Callable] = None, tp: int = 1,
          tp_plan: Any = "auto") -> SplitStages:
    """Cut ``model`` into pipeline stages, ready for ``mpmd.Pipeline(stages, ...)``.

    * Markers: with ``mpmd.PipelineYield()`` layers in the model, cut exactly there
      (``num_stages``, if given, must equal markers + 1; ``balance`` must be left out).
    * ``balance="params"`` (the default): ``num_stages`` stages of about equal
      parameter count (min-max).
    * ``balance="time"``: time each layer's forward + backward on ``sample`` (one
      microbatch of inputs; each layer runs on the previous layer's output; median of
      ``repeats``), then the min-max partition by dynamic programming, where each stage
      also pays ``2 * (latency + bytes / bytes_per_s)`` per boundary it touches (the
      activation forward, its gradient back; ``bytes_per_s`` defaults to
      ``mpmd.planning.DEFAULT_BYTES_PER_S`` for the sample's device).  With ``loss_fn``,
      ``sample`` is ``(inputs, targets)`` and the last layer's time includes the loss,
      as the last stage's will (a wide output head's cross-entropy is not free).
    * ``balance=[n0, n1, ...]``: stage ``i`` gets the next ``n_i`` layers.
    * A Hugging Face causal LM (``mpmd.planning.HF_CAUSAL_LMS``: GPT-2, Llama, Mistral,
      Qwen2, Qwen3; the MoE Qwen3-MoE, Mixtral, DeepSeek-V3) is cut into whole decoder
      layers by ``balance="params"`` or a list of decoder layers per stage; the first stage
      takes ``input_ids``, the last returns logits, each stage's ``forward(x,
      attention_mask=None, position_ids=None)`` builds its own mask and positions, its keys
      are the model's (``mpmd.planning.hf``); on meta: factories (Note [meta-built stages]).

    * ``tp=T`` (the stages will run with ``Pipeline(tp=T, tp_plan=...)``): balance what
      one of a stage's ``T`` tensor-parallel ranks carries under ``tp_plan`` (default
      ``"auto"``): Note [TP balance].  ``tp=1`` (the default) changes nothing.

    Returns ``SplitStages`` (a list of ``nn.Sequential``); the per-stage table is logged
    to ``mpmd.planning.split`` and printed when ``verbose``.
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"split's tp must be a positive integer (the tensor-parallel degree the stages will run "
                         f"at), got {tp!r}; for Pipeline(tp=(1, 2)) split at the largest")
    if _is_hugging_face(model):
        return _split_hugging_face(model, num_stages, balance, verbose, tp, tp_plan)
    if loss_fn is not None:
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
            raise ValueError("with loss_fn, sample must be a pair (inputs, targets) of one microbatch")
        sample, targets = sample
    else:
        targets = None
    layers = _layers(model, sample)
    marks = [i for i, m in enumerate(layers) if isinstance(m, PipelineYield)]
    times: Optional[list[float]] = None
    boundary: list[float] = []
    if marks:
        counts = _counts_from_markers(layers, marks, num_stages, balance)
        layers = [m for m in layers if not isinstance(m, PipelineYield)]
        how = f"{len(marks)} PipelineYield markers"
    else:
        k = _num_stages(layers, num_stages, balance)
        profiles = [tp_profile(m, tp_plan if tp > 1 else None, layer=True) for m in layers]
        if balance is None or balance == "params":
            counts = partition([p.per_rank(tp) for p in profiles], k)
            how = "balance='params'"
        elif balance == "time":
            times, boundary = _layer_times(layers, sample, targets, loss_fn, repeats, bytes_per_s, tp, profiles)
            counts = partition(times, k, boundary)
            how = "balance='time'"
        else:
            counts = _check_counts(balance, len(layers), num_stages)
            how = f"balance={list(counts)}"
    modules, at = [], 0
    for n in counts:
        modules.append(nn.Sequential(*layers[at:at + n]))
        at += n
    predicted = _stage_costs(times, boundary, counts) if times is not None else None
    return _split_stages(modules, counts, predicted, how, verbose, tp, tp_plan)


def _split_stages(modules: list[nn.Module], counts: Sequence[int], predicted_s: Optional[list[float]], how: str,
                  verbose: bool, tp: int = 1, tp_plan: Any = None) -> SplitStages:
    stages = SplitStages(modules)
    stages.layer_counts = list(counts)
    stages.param_counts = [_param_count(s) for s in stages]
    stages.tp = tp
    stages.rank_param_counts = [tp_profile(s, tp_plan if tp > 1 else None).per_rank(tp) for s in stages]
    if tp > 1:
        how += f", per rank of tp={tp}"
    stages.predicted_s = predicted_s
    stages.table = _table(stages, how)
    log.info("%s", stages.table)
    if verbose:
        print(stages.table, flush=True)
    return stages


def _is_hugging_face(model: Any) -> bool:
    return isinstance(model, nn.Module) and any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _split_hugging_face(model: nn.Module, num_stages: Optional[int], balance: Any, verbose: bool, tp: int,
                        tp_plan: Any) -> SplitStages:
    from . import hf  # its stages load transformers (an optional dependency) only when they run

    balancer = partition
    if tp > 1:  # each decoder layer's count (the embeddings and head with the end ones) times its per-rank share
        decoder = model.transformer.h if hasattr(model, "transformer") else model.model.layers
        shares = [per_rank_share(tp_profile(layer, tp_plan, layer=True).share, tp) for layer in decoder]

        def balancer(costs: Sequence[float], k: int) -> list[int]:
            return partition([c * f for c, f in zip(costs, shares)], k)

    modules, counts, how = hf.split_causal_lm(model, num_stages, balance, balancer=balancer)
    stages = _split_stages(modules, counts, None, how, verbose, tp, tp_plan)
    stages[:] = meta_factories(model, counts) if is_on_meta(model) else stages  # Note [meta-built stages]
    return stages


# -- the partition ---------------------------------------------------------------------------------


def partition(costs: Sequence[float], num_stages: int, boundary: Optional[Sequence[float]] = None) -> list[int]:
    """Layer counts of the contiguous partition into ``num_stages`` stages whose most
    expensive stage is cheapest.

    A stage of layers ``[i, j)`` costs ``sum(costs[i:j])`` plus ``boundary[i-1]`` when
    it has a stage before it and ``boundary[j-1]`` when it has one after it
    (``boundary[k]`` is the cost of the cut after layer ``k``).  Dynamic programming,
    ``O(num_stages * n^2)``; ties go to the earliest cut.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot cut {n} layers into {num_stages} stages; use 1..{n} stages")
    bnd = list(boundary) if boundary is not None else [0.0] * max(n - 1, 0)
    if len(bnd) != n - 1:
        raise ValueError(f"boundary needs one cost per cut ({n - 1}), got {len(bnd)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(i: int, j: int) -> float:
        return prefix[j] - prefix[i] + (bnd[i - 1] if i > 0 else 0.0) + (bnd[j - 1] if j < n else 0.0)

    inf = math.inf
    # best[k][j]: the least max-stage cost of layers [0, j) in k stages; cut[k][j]: start of the last.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for j in range(k, n - (num_stages - k) + 1):
            for i in range(k - 1, j):
                v = max(best[k - 1][i], cost(i, j))
                if v < best[k][j]:
                    best[k][j], cut[k][j] = v, i
    counts, j = [], n
    for k in range(num_stages, 0, -1):
        i = cut[k][j]
        counts.append(j - i)
        j = i
    return counts[::-1]


def _stage_costs(costs: Sequence[float], boundary: Sequence[float], counts: Sequence[int]) -> list[float]:
    out, i, n = [], 0, len(costs)
    for c in counts:
        j = i + c
        out.append(sum(costs[i:j]) + (boundary[i - 1] if i > 0 else 0.0) + (boundary[j - 1] if j < n else 0.0))
        i = j
    return out


# -- what can be cut --------------------------------------------------------------------------------


def _layers(model: Any, sample: Any) -> list[nn.Module]:
    if isinstance(model, (nn.Sequential, nn.ModuleList)):
        layers = list(model)
    elif isinstance(model, (list, tuple)) and all(isinstance(m, nn.Module) for m in model):
        layers = list(model)
    elif isinstance(model, nn.Module):
        layers = list(model.children())
        if not layers or not _runs_children_in_order(model, layers, sample):
            why = ("has no child modules" if not layers else
                   "does not compute the same as running its children in order on sample" if sample is not None else
                   "is not an nn.Sequential, and without sample mpmd.split cannot check that its forward "
                   "runs its children in order")
            raise ValueError(
                f"mpmd.split cannot cut {type(model).__name__}: it {why}. Write the model as "
                f"nn.Sequential(layer, ..., layer) with mpmd.PipelineYield() where a stage should end, or pass "
                f"explicit stages: mpmd.Pipeline([stage0, stage1, ...]) with one nn.Module per stage")
    else:
        raise ValueError(f"mpmd.split needs an nn.Module (nn.Sequential of layers) or a list of modules, "
                         f"got {type(model).__name__}")
    if not layers:
        raise ValueError("the model has no layers to cut; give it at least one layer per stage")
    return layers


def _runs_children_in_order(model: nn.Module, layers: list[nn.Module], sample: Any) -> bool:
    if sample is None:
        return False
    was = model.training
    model.eval()  # dropout off, so both runs are deterministic
    try:
        with torch.no_grad():
            want, got = model(sample), nn.Sequential(*layers)(sample)
    except Exception:  # noqa: BLE001 - a forward that does not chain is not a sequence
        return False
    finally:
        model.train(was)
    return _same(want, got)


def _same(a: Any, b: Any) -> bool:
    try:
        sa, ta = flatten(a)
        sb, tb = flatten(b)
    except TypeError:
        return False
    return sa == sb and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(ta, tb))


def _counts_from_markers(layers, marks, num_stages, balance) -> list[int]:
    if balance is not None:
        raise ValueError(f"the model has {len(marks)} PipelineYield markers, which already fix the stages; "
                         f"drop balance={balance!r} or remove the markers")
    counts, start = [], 0
    for pos in marks + [len(layers)]:
        counts.append(pos - start)
        start = pos + 1
    if num_stages is not None and num_stages != len(counts):
        raise ValueError(f"num_stages={num_stages} but the model's {len(marks)} PipelineYield markers make "
                         f"{len(counts)} stages; pass num_stages={len(counts)} (or leave it out), or move the markers")
    empty = [i for i, c in enumerate(counts) if c == 0]
    if empty:
        raise ValueError(f"stage {empty[0]} would be empty: a PipelineYield marker starts or ends the model, or two "
                         f"markers are adjacent (marker positions {marks} among {len(layers)} children); "
                         f"put at least one layer between markers")
    return counts


def _num_stages(layers: list, num_stages: Optional[int], balance: Any) -> int:
    if isinstance(balance, (list, tuple)):
        return num_stages if num_stages is not None else len(balance)
    if balance is not None and balance not in BALANCE_MODES:
        raise ValueError(f"unknown balance {balance!r}; use 'params', 'time' or a list of layer counts per stage")
    if num_stages is None:
        raise ValueError("split needs num_stages (or PipelineYield markers in the model, or balance=[layer counts])")
    if not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"num_stages must be a positive integer, got {num_stages!r}")
    if num_stages > len(layers):
        raise ValueError(f"num_stages={num_stages} is more than the model's {len(layers)} layers (each stage needs "
                         f"one); use num_stages <= {len(layers)}, or write the model with finer layers")
    return num_stages


def _check_counts(balance: Sequence[int], n: int, num_stages: Optional[int]) -> list[int]:
    counts = list(balance)
    if not counts or any(not isinstance(c, int) or isinstance(c, bool) or c < 1 for c in counts):
        raise ValueError(f"balance={counts!r}: give a positive number of layers for every stage")
    if num_stages is not None and num_stages != len(counts):
        raise ValueError(f"num_stages={num_stages} but balance={counts} lists {len(counts)} stages; make them agree")
    if sum(counts) != n:
        raise ValueError(f"balance={counts} covers {sum(counts)} layers but the model has {n}; "
                         f"the counts must add up to {n}")
    return counts


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


# -- measuring layers -------------------------------------------------------------------------------

# Note [boundary cost]: a cut after layer k sends its output forward and the gradient
# of the same size back, once per microbatch; both stages at the cut spend that time,
# so each pays 2 * (latency + bytes / bytes_per_s) for every cut it touches.
#
# Note [TP balance]: with tp=T a stage runs on T ranks that each hold the unsharded
# modules whole and 1/T of what the TP plan shards (Note [TP cost model] in tp.py).
# balance="params" weighs a layer by the parameters one rank holds, unsharded + sharded
# / T; balance="time" by its measured time times (1 - share + share / T), share being
# the sharded part of its parameters, plus its TP all-reduces of its output's bytes
# (forward and backward; a ring over T ranks at latency and bytes_per_s).  Boundaries
# are not sharded: every rank sends the whole activation to its counterpart, so the
# boundary cost stays.  A Hugging Face model's decoder layers are weighed by their
# per-rank share (the embeddings and head, counted with the first and last layer, by
# that layer's).  With tp=1 every layer weighs as before.


def _layer_times(layers: list[nn.Module], sample: Any, targets: Any, loss_fn: Optional[Callable], repeats: int,
                 bytes_per_s: Optional[float], tp: int = 1, profiles: Sequence[Any] = ()
                 ) -> tuple[list[float], list[float]]:
    if sample is None:
        raise ValueError("balance='time' measures each layer on a sample: pass sample=<one microbatch of inputs>")
    _, tensors = flatten(sample, where="sample")
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(p.device != device for m in layers for p in m.parameters()):
        raise ValueError(f"balance='time' runs the layers on the sample's device ({device}); "
                         "move the model and the sample to the same device")
    kind = "cuda" if device.type == "cuda" else "cpu"
    bw = bytes_per_s if bytes_per_s is not None else DEFAULT_BYTES_PER_S[kind]
    latency = DEFAULT_LATENCY_S[kind]
    # One thread on CPU, as a Ray actor with num_cpus=1 runs.  Copies are timed, so the
    # user's layers (gradients, running statistics) and the random state are untouched.
    with measuring(device, threads=1):
        copies = [copy.deepcopy(layer).train() for layer in layers]
        measured = measure_chain(copies, sample, targets=targets, loss_fn=loss_fn, repeats=repeats)
    times = [m.f + m.full for m in measured]
    out_bytes = [m.out_bytes for m in measured]
    if tp > 1:  # Note [TP balance]
        times = [t * per_rank_share(p.share, tp)
                 + collective_seconds(b, tp, p.forward + p.backward, latency, bw)
                 for t, p, b in zip(times, profiles, out_bytes)]
    boundary = [2 * (latency + b / bw) for b in out_bytes[:-1]]
    return times, boundary


def _table(stages: SplitStages, how: str) -> str:
    lines = [f"mpmd.split: {len(stages)} stages by {how}",
             f"  {'stage':>5}  {'layers':>7}  {'params':>11}" + (f"  {'per rank':>11}" if stages.tp > 1 else "")
             + ("  f+b ms (with transfers)" if stages.predicted_s else "")]
    at = 0
    for i, (n, p) in enumerate(zip(stages.layer_counts, stages.param_counts)):
        row = f"  {i:>5}  {f'{at}-{at + n - 1}':>7}  {p:>11,}"
        if stages.tp > 1:
            row += f"  {round(stages.rank_param_counts[i]):>11,}"
        if stages.predicted_s:
            row += f"  {stages.predicted_s[i] * 1e3:>10.3f}"
        lines.append(row)
        at += n
    if stages.predicted_s:
        worst = max(stages.predicted_s)
        mean = sum(stages.predicted_s) / len(stages.predicted_s)
        lines.append(f"  slowest stage {worst * 1e3:.3f} ms, mean {mean * 1e3:.3f} ms (balance {mean / worst:.0%})")
    return "\n".join(lines)
