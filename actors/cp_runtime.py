"""Context parallelism on the actors: each microbatch's sequence sharded over the stage's CP
group, the shard's attention context the models read, and the loss weighted by the shard's
share of the counted tokens.  The core (zigzag sharding, ring attention) is actors/context.py.

Note [context-parallel runtime]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
With ``Pipeline(cp=C)`` each stage runs on ``C`` actors (CP ranks, Note [device grid] in
actors/grid.py).  Every CP rank receives the whole microbatch (as TP ranks do) and keeps its
zigzag shard (``shard_sequence``, Note [zigzag sharding]): the inputs, the targets and every
per-microbatch side input with two or more dimensions are ``[batch, seq, ...]`` and are cut along
dim 1.  CP rank ``c`` of stage ``s`` sends to and receives from CP rank ``c`` of the next and the
previous stage (``DeviceGrid.pair_groups``), so activations never leave their shard.

While a stage computes (``F``, ``B``, ``I``, ``W``: a recomputed forward replays inside the
backward) the interpreter makes a ``ShardContext`` active (``sharded``); a model's attention
reads it (``active_shard``) and calls ``ShardContext.attend`` instead of its own: mpmd.models.gpt's
``Block.attention`` and, for Hugging Face Llama-family stages, the attention function registered
as ``"mpmd_cp"`` (``use_ring_attention``).  Positions are global (``zigzag_indices``) for the
causal mask and for RoPE / position embeddings, or, with ``document_mask``, the documents'
own positions (the ``position_ids`` side input, sharded) with attention kept within each
document (``document_ids`` of the whole sequence, sharded).  A stage says it can be sharded with
``supports_context_parallel = True`` (checked before actors start, mpmd/runtime/cp.py).

The loss: ``loss_fn`` is a mean over the counted tokens of what it is given (targets equal to
-100 do not count, as ``cross_entropy``'s default).  On CP rank ``c`` it sees ``n_c`` of the
microbatch's ``N`` counted tokens, so ``loss_c * n_c / N`` sums over the CP group to the loss of
the whole sequence.  The CP ranks then join the gradient average of the replicas: the stage's
DP group is its ``dp x cp`` actors, and an average over it of gradients of ``C * loss_c * n_c / N``
is the sum over CP ranks and the mean over replicas that is wanted.  So the microbatch loss on
CP rank ``c`` is weighted by ``C * n_c / N`` (``loss_weights``), for the backward and for the
report: the controller's mean over the ``dp x cp`` reports is the whole sequence's loss.  One
reduction, the buckets, overlap and ZeRO's machinery as with ``dp`` alone.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from .context import document_ids, ring_attention, shard_sequence, zigzag_indices

__all__ = ["ShardContext", "StepShards", "active_shard", "sharded", "use_ring_attention", "IGNORE_INDEX"]

IGNORE_INDEX = -100  # targets that do not count in the loss (cross_entropy's default)
_ACTIVE: list = [None]  # the context of the stage computing now (the actor's one compute thread)


class ShardContext:
    """What a stage's attention needs of the shard it computes: the CP group (None: one shard,
    document masking alone), this rank, and with document masking each token's document id and
    position in its document (``[B, s]``, this shard's)."""

    def __init__(self, group: Any, cp: int, rank: int, docs: Optional[torch.Tensor] = None,
                 doc_positions: Optional[torch.Tensor] = None) -> None:
        self.group, self.cp, self.rank = group, cp, rank
        self.docs, self.doc_positions = docs, doc_positions

    def seq_len(self, local: int) -> int:
        """The whole sequence's length from this shard's ``local`` tokens."""
        return local * self.cp

    def positions(self, local: int, device: torch.device) -> torch.Tensor:
        """The global positions of this shard's tokens (``[local]``): the causal mask's."""
        return zigzag_indices(local * self.cp, self.cp, self.rank).to(device)

    def position_ids(self, local: int, device: torch.device) -> torch.Tensor:
        """Positions for RoPE or a position embedding: ``[B, local]`` within documents, else ``[1, local]``."""
        if self.doc_positions is not None:
            return self.doc_positions.to(device)
        return self.positions(local, device).unsqueeze(0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
        """Exact causal (and document) attention of this shard's queries over the whole sequence."""
        return ring_attention(q, k, v, self.group, self.positions(q.shape[2], q.device), self.docs, scale=scale)


def active_shard() -> Optional[ShardContext]:
    """The shard the stage computing now runs on; None without CP or document masking."""
    return _ACTIVE[0]


@contextlib.contextmanager
def sharded(context: Optional[ShardContext]) -> Iterator[None]:
    """Make ``context`` the active shard while a stage computes (None: nothing changes)."""
    before, _ACTIVE[0] = _ACTIVE[0], context if context is not None else _ACTIVE[0]
    try:
        yield
    finally:
        _ACTIVE[0] = before


def _per_token(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() >= 2


def _shard_value(value: Any, cp: int, rank: int) -> Any:
    from .values import flatten, unflatten

    spec, tensors = flatten(value, where="CP shard")
    return unflatten(spec, [shard_sequence(t, 1, cp, rank) if _per_token(t) else t for t in tensors])


class StepShards:
    """One step's CP state on an actor: its microbatches cut to this rank's shard, per microbatch
    the shard context and the loss weight (Note [context-parallel runtime])."""

    def __init__(self, group: Any, cp: int, rank: int, document_mask: bool) -> None:
        self.group, self.cp, self.rank, self.document_mask = group, cp, rank, document_mask
        self.contexts: list = []
        self.weights: list = []

    def cut(self, inputs: Optional[list], targets: Optional[list], side: dict) -> tuple:
        """``(inputs, targets, side)`` of a step (per microbatch) cut to this rank's shard."""
        positions = side.get("position_ids") if self.document_mask else None
        given = [v for v in (inputs, targets, positions) if v is not None]
        count = len(given[0]) if given else 0  # a middle stage without document masking: none
        self.contexts, self.weights = [], [1.0] * count
        for mb in range(count):
            docs = doc_positions = None
            if positions is not None:
                whole = positions[mb]
                docs = shard_sequence(document_ids(whole), whole.dim() - 1, self.cp, self.rank)
                doc_positions = shard_sequence(whole, whole.dim() - 1, self.cp, self.rank)
            self.contexts.append(ShardContext(self.group, self.cp, self.rank, docs, doc_positions))
        if targets is not None:
            self.weights = [self._weight(t) for t in targets]
        if self.cp == 1:
            return inputs, targets, side
        cut = lambda values: None if values is None else [_shard_value(v, self.cp, self.rank) for v in values]  # noqa: E731
        return cut(inputs), cut(targets), {n: cut(v) for n, v in side.items()}

    def _weight(self, target: Any) -> float:
        """``C * n_c / N`` for integer targets (counted: not -100), 1 otherwise (equal shards)."""
        if self.cp == 1 or not isinstance(target, torch.Tensor) or target.is_floating_point() or target.dim() < 2:
            return 1.0
        counted = target != IGNORE_INDEX
        total = int(counted.sum())
        mine = int(shard_sequence(counted, 1, self.cp, self.rank).sum())
        if total and not mine:
            raise ValueError(f"CP rank {self.rank}'s shard of a microbatch has no counted target (all are "
                             f"{IGNORE_INDEX}), so a mean loss over it is undefined; pack the sequences so that "
                             f"every 1/{2 * self.cp} of a sequence holds a counted token")
        return self.cp * mine / total if total else 1.0

    def context(self, mb: int) -> Optional[ShardContext]:
        return self.contexts[mb] if 0 <= mb < len(self.contexts) else ShardContext(self.group, self.cp, self.rank)

    def weight(self, mb: int) -> float:
        return self.weights[mb] if 0 <= mb < len(self.weights) else 1.0


def _hf_ring_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None, **kwargs: Any):
    """Hugging Face's attention interface (``"mpmd_cp"``): q ``[B, Hq, s, D]``, k/v ``[B, Hkv, s, D]``
    in, ``([B, s, Hq, D], None)`` out; the shard's positions and documents from the active context."""
    shard = active_shard()
    if shard is None:
        raise RuntimeError("the 'mpmd_cp' attention ran outside a CP or document-masked stage's compute")
    if dropout:
        raise ValueError("attention dropout cannot run under context parallelism; set attention_dropout=0")
    return shard.attend(query, key, value, scale=scaling).transpose(1, 2).contiguous(), None


def use_ring_attention(module: torch.nn.Module) -> None:
    """Point a Hugging Face stage's attention (its config's ``_attn_implementation``) at the ring
    (Note [context-parallel runtime]); other stages read ``active_shard`` themselves."""
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        return
    from transformers import AttentionInterface  # only Hugging Face stages get here

    AttentionInterface.register("mpmd_cp", _hf_ring_attention)
    # transformers reads the choice from the config each call and gives a config no public setter (a
    # PreTrainedModel's set_attn_implementation sets this same attribute; a stage is not a PreTrainedModel)
    setattr(config, "_attn_implementation", "mpmd_cp")
