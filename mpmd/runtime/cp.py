"""Context parallelism on the controller: its checks, before any actor starts or any step is
sent, and the last stage's outputs joined from the CP ranks' shards (Note [context-parallel
runtime] in actors/cp_runtime.py; docs/context.md)."""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from actors.context import check_sequence_length, unshard_sequence
from actors.grid import DeviceGrid
from actors.values import flatten, unflatten

__all__ = ["check_cp_pipeline", "check_cp_step", "join_cp_outputs", "attention_calls"]


def _why_not_sharded(module: torch.nn.Module) -> Optional[str]:
    """Why ``module``'s attention cannot be sharded over a CP group (None: it can)."""
    if not getattr(module, "supports_context_parallel", False):
        return (f"{type(module).__name__} does not say where its attention is (no supports_context_parallel = True); "
                "stages of mpmd.models.gpt (GPTStage) and Hugging Face Llama-family stages (mpmd.planning.hf's "
                "LlamaStage) are supported, and a stage of your own can set supports_context_parallel = True and "
                "call actors.cp_runtime.active_shard().attend(q, k, v) in its attention (and set "
                "context_parallel_calls to the number of such calls per forward, for the order check)")
    config = getattr(module, "config", None)
    if config is None:
        return None
    if any(kind != "full_attention" for kind in getattr(module, "layer_types", ())):
        return "it has sliding-window attention layers (the ring's mask is causal and by document only)"
    if float(getattr(config, "attention_dropout", 0.0) or 0.0) > 0:
        return f"attention_dropout={config.attention_dropout} (the ring computes attention without dropout)"
    for name in ("attn_logit_softcapping", "attention_sinks"):
        if getattr(config, name, None):
            return f"{name} is set (the ring computes plain softmax attention)"
    return None


def attention_calls(module: Any) -> int:
    """How many attention calls a stage's forward makes, each a ring of exchanges under cp (Note
    [ring exchanges in the order model] in schedules/context_order.py): the stage's
    ``context_parallel_calls`` (``GPTStage``, ``LlamaStage``, a stage of your own), else its
    Hugging Face-style attention modules (``...Attention`` with a ``config``)."""
    declared = getattr(module, "context_parallel_calls", None)
    if declared is not None:
        return int(declared)
    if not isinstance(module, torch.nn.Module):
        return 0
    return sum(1 for m in module.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config"))


def check_cp_pipeline(modules: Sequence[Any], layout: Any, loss_fn: Optional[Callable], *, sliced: bool,
                      planned: bool) -> None:
    """Refuse what context parallelism (``layout.cp``) or document masking cannot run: stages whose
    attention cannot be sharded, TeraPipe's token slices, the planner's choices, a loss that
    shifts the labels itself."""
    cp, docs = layout.cp, layout.document_mask
    if cp == 1 and not docs:
        return
    what = f"cp={cp}" if cp > 1 else "document_mask=True"
    if sliced:
        raise ValueError(f"{what} with TeraPipe's token slices is not supported (each slice would need its own "
                         "shards); use a microbatch schedule such as '1f1b' with cp, or TeraPipe with cp=1")
    if planned and cp > 1:
        raise ValueError(f"cp={cp} with schedule='auto', num_microbatches='auto' or tp choices is not supported: the "
                         "planner does not model context parallelism; name the schedule and the microbatch count")
    for s, module in enumerate(modules):
        if isinstance(module, torch.nn.Module):
            why = _why_not_sharded(module)
            if why is not None:
                raise ValueError(f"{what}: stage {s}'s attention cannot be sharded: {why}")
    if cp > 1 and getattr(loss_fn, "__name__", "") == "causal_lm_loss":
        raise ValueError(f"cp={cp} with causal_lm_loss: it shifts the labels inside the loss, across the shards' "
                         "boundaries; shift them before the step (targets[t] = labels[t + 1], -100 at the end) "
                         "and use a loss without the shift, e.g. mpmd.models.gpt.lm_loss")


def check_cp_step(layout: Any, inputs: Any, targets: Any, side: Optional[dict]) -> None:
    """Refuse a step the shards cannot take: a sequence length not divisible by ``2 * cp``
    (zigzag sharding), document masking without ``position_ids``."""
    cp, docs = layout.cp, layout.document_mask
    if docs and (not side or "position_ids" not in side):
        raise ValueError("document_mask=True needs each step's position_ids (restarting at 0 at each document, "
                         "[batch, seq]) as a side input: pipe.step(inputs, targets, position_ids=...)")
    if (cp > 1 or docs) and side and "attention_mask" in side:
        raise ValueError("an attention_mask side input cannot be applied under cp > 1 or document_mask: the ring's "
                         "mask is causal and by document only; mark padding with -100 targets (and documents with "
                         "position_ids and document_mask=True) instead")
    if cp == 1:
        return
    values = [("inputs", inputs), ("targets", targets)] + [(f"side input {n!r}", v) for n, v in (side or {}).items()]
    lengths = set()
    for name, value in values:
        if value is None:
            continue
        for t in flatten(value, where=name)[1] if not isinstance(value, (int, float)) else ():
            if isinstance(t, torch.Tensor) and t.dim() >= 2:
                try:
                    check_sequence_length(t.shape[1], cp)
                except ValueError as e:
                    raise ValueError(f"cp={cp}: {name}'s dim 1 (the sequence) has {t.shape[1]} tokens: {e}") from None
                lengths.add(t.shape[1])
    if len(lengths) > 1:
        raise ValueError(f"cp={cp} shards every [batch, seq, ...] tensor along dim 1, but the inputs, targets and "
                         f"side inputs have sequences of {sorted(lengths)} tokens; give them one length")


def join_cp_outputs(grid: DeviceGrid, outputs: Sequence[Optional[list]]) -> list:
    """The last stage's outputs per microbatch, in replica order, each whole again: ``outputs``
    are the actors' (in actor order; None where an actor reports none), and the ``grid.cp``
    actors of a replica's last stage hold one zigzag shard each of every microbatch's output."""
    if grid.cp == 1:
        return [o for part in outputs for o in (part or ())]
    shards: dict = {}  # replica -> CP rank -> that rank's microbatch outputs
    for i, part in enumerate(outputs):
        if part is not None:
            shards.setdefault(grid.coord(i).replica, {})[grid.cp_rank_of(i)] = part
    joined = []
    for replica in sorted(shards):
        ranks = shards[replica]
        for mb in range(len(ranks[0])):
            spec, _ = flatten(ranks[0][mb], where="stage output")
            pieces = [flatten(ranks[c][mb], where="stage output")[1] for c in range(grid.cp)]
            joined.append(unflatten(spec, [unshard_sequence([p[k] for p in pieces], 1, grid.cp) if pieces[0][k].dim() >= 2
                                           else pieces[0][k] for k in range(len(pieces[0]))]))
    return joined
