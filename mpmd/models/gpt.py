"""A small GPT cut into pipeline stages, for the demo, the benchmarks and the examples.

Its stages also run TeraPipe's token slices (``mpmd/terapipe/protocol.py``).
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

from actors.cp_runtime import active_shard
from actors.vocab_loss import vocab_parallel_cross_entropy

from ..moe import MoE
from ..terapipe.protocol import is_token_slice

__all__ = ["GPTConfig", "Embedding", "Block", "Head", "GPTStage", "gpt_stages", "char_dataset", "lm_loss"]


class GPTConfig:
    """The model's sizes; ``n_experts > 0`` makes every block's MLP a mixture of experts
    (``mpmd.moe.MoE``: ``top_k`` of ``n_experts`` experts of ``expert_hidden`` units, shared experts
    of ``shared_hidden`` units when > 0, router options in ``router``, e.g. ``score_func="sigmoid"``)."""

    def __init__(self, vocab_size: int = 64, seq_len: int = 64, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 4, *, n_experts: int = 0, top_k: int = 2, expert_hidden: int = 0,
                 shared_hidden: int = 0, router: Optional[dict] = None) -> None:
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.vocab_size, self.seq_len, self.d_model = vocab_size, seq_len, d_model
        self.n_heads, self.n_layers = n_heads, n_layers
        self.n_experts, self.top_k = n_experts, top_k
        self.expert_hidden, self.shared_hidden = expert_hidden or 2 * d_model, shared_hidden
        self.router = dict(router or {})


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Token plus position embeddings; ``offset`` is the position of ``idx[:, 0]`` (a token slice).
        Under context parallelism or document masking the shard's positions (Note [context-parallel
        runtime] in actors/cp_runtime.py)."""
        shard = active_shard()
        if shard is not None:
            if shard.seq_len(idx.shape[1]) > self.pos.num_embeddings:
                raise ValueError(f"a sequence of {shard.seq_len(idx.shape[1])} tokens is past the model's seq_len "
                                 f"({self.pos.num_embeddings})")
            return self.tok(idx) + self.pos(shard.position_ids(idx.shape[1], idx.device))
        if offset + idx.shape[1] > self.pos.num_embeddings:
            raise ValueError(f"tokens {offset}..{offset + idx.shape[1] - 1} are past the model's seq_len "
                             f"({self.pos.num_embeddings}); use sequences of at most {self.pos.num_embeddings} tokens")
        pos = torch.arange(offset, offset + idx.shape[1], device=idx.device)
        return self.tok(idx) + self.pos(pos)


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        if cfg.n_experts:
            self.mlp = MoE(cfg.d_model, cfg.expert_hidden, cfg.n_experts, cfg.top_k,
                           shared_intermediate=cfg.shared_hidden, **cfg.router)
        else:
            self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
                                     nn.Linear(4 * cfg.d_model, cfg.d_model))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        return tuple(z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        # The t queries are the last t of keys.shape[2] positions: query r sees keys <= r + context.
        b, h, t, dh = q.shape
        context = keys.shape[2] - t
        att = (q @ keys.transpose(-2, -1)) / math.sqrt(dh)
        mask = torch.ones(t, context + t, dtype=torch.bool, device=q.device).tril(diagonal=context)
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ values).transpose(1, 2).reshape(b, t, h * dh))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(x)
        shard = active_shard()
        if shard is not None:  # the sequence's other shards over the CP ring (Note [context-parallel runtime])
            b, h, t, dh = q.shape
            return self.proj(shard.attend(q, k, v).transpose(1, 2).reshape(b, t, h * dh))
        return self._attend(q, k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))

    def forward_slice(self, x: torch.Tensor, past_k: Optional[torch.Tensor], past_v: Optional[torch.Tensor]):
        """A token slice after the earlier tokens' keys/values ``past_k``/``past_v`` (batch, heads,
        tokens, d_head), or None for the first slice.  Returns (output, k, v): k, v are this
        slice's own keys and values, for the slices after it."""
        q, k, v = self._heads(self.ln1(x))
        keys = k if past_k is None else torch.cat([past_k, k], dim=2)
        values = v if past_v is None else torch.cat([past_v, v], dim=2)
        x = x + self._attend(q, keys, values)
        return x + self.mlp(self.ln2(x)), k, v


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


# Note [token-sliced context gradients]
# -------------------------------------
# TeraPipe runs a sequence through a stage as token slices.  Slice i attends to the
# keys/values (K/V) of slices < i, which the stage keeps as *detached leaves* that
# require grad, so each slice has its own autograd graph and its own backward.  The
# backward of slice j deposits dL/dK, dL/dV of earlier slices into those leaves'
# ``.grad``.  Slice i's own K/V are graph-attached; ``_ContextGrad`` ties them to the
# stage output as an identity whose backward adds, as the K/V gradient, whatever the
# later slices deposited into slice i's leaves.  So the runtime's ordinary backward
# of the stage output (``actors.stage_exec.backward_full``) back-propagates the
# context gradient too, with no extra protocol, provided the later slices' backwards
# ran first: Note [token-sliced order] in schedules/token_sliced.py.  The order is
# checked here, at run time, as well.


class _SequenceContext:
    """The K/V leaves of one sequence's slices seen so far on one stage."""

    def __init__(self, owner: dict, key: int) -> None:
        self.owner, self.key = owner, key
        self.length = 0  # tokens seen
        self.slices: list[Optional[list[torch.Tensor]]] = []  # per slice: [k0, v0, k1, v1, ...] leaves
        self.backward_done: set[int] = set()

    def past(self, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if not self.slices:
            return None, None
        ks = [kv[2 * layer] for kv in self.slices]
        vs = [kv[2 * layer + 1] for kv in self.slices]
        return (torch.cat(ks, dim=2), torch.cat(vs, dim=2)) if len(ks) > 1 else (ks[0], vs[0])

    def add(self, own: list[torch.Tensor], tokens: int, grad: bool) -> int:
        self.slices.append([t.detach().requires_grad_(grad) for t in own])
        self.length += tokens
        return len(self.slices) - 1

    def take_grads(self, index: int) -> list[Optional[torch.Tensor]]:
        """The context gradient later slices left for slice ``index``; releases its leaves."""
        later = [j for j in range(index + 1, len(self.slices)) if j not in self.backward_done]
        if later:
            raise RuntimeError(
                f"the backward of token slice {index} of sequence {self.key} ran before the backward of its "
                f"slice {later[0]}; a token-sliced schedule runs a sequence's backwards in reverse slice order "
                "(Note [token-sliced order] in schedules/token_sliced.py)")
        grads = [t.grad for t in self.slices[index]]
        self.slices[index] = None
        self.backward_done.add(index)
        if index == 0 and self.owner.get(self.key) is self:
            del self.owner[self.key]
        return grads


class _ContextGrad(torch.autograd.Function):
    """Identity on the stage output; its backward adds the context gradient of the slice's
    own K/V (Note [token-sliced context gradients])."""

    @staticmethod
    def forward(ctx, context: _SequenceContext, index: int, out: torch.Tensor, *own: torch.Tensor):
        ctx.context, ctx.index = context, index
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, None, grad, *ctx.context.take_grads(ctx.index))


class GPTStage(nn.Sequential):
    """A run of GPT layers (``Embedding``, ``Block``s, ``Head``) that is one pipeline stage.

    On a tensor it is ``nn.Sequential``.  On a token slice
    (``mpmd.terapipe.token_slice(x, seq, pos)``) it attends to the keys/values of the
    earlier slices of sequence ``seq`` kept on this stage, and returns the next stage's
    slice value (or the logits, with the head); see Note [token-sliced context gradients].
    """

    supports_token_slices = True
    supports_context_parallel = True  # Block.attention and Embedding read the active shard

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__(*layers)
        self._contexts: dict[int, _SequenceContext] = {}

    @property
    def context_parallel_calls(self) -> int:
        """Attention calls per forward: one per ``Block``, each a ring under cp (Note [ring
        exchanges in the order model] in schedules/context_order.py)."""
        return sum(isinstance(layer, Block) for layer in self)

    def __getstate__(self) -> dict:
        # Copies and pickles (shipping to actors) start with no held context.
        state = self.__dict__.copy()
        state["_contexts"] = {}
        return state

    def reset_contexts(self) -> None:
        self._contexts.clear()

    @property
    def sequences_held(self) -> int:
        """Sequences whose key/value context this stage holds (released by their slice-0 backward)."""
        return len(self._contexts)

    @property
    def vocab_size(self) -> Optional[int]:
        """Token ids the stage takes (a first stage, with the embedding), else None."""
        emb = self._embedding()
        return emb.tok.num_embeddings if emb is not None else None

    @property
    def max_seq_len(self) -> Optional[int]:
        """The longest sequence its position embedding covers (a first stage), else None."""
        emb = self._embedding()
        return emb.pos.num_embeddings if emb is not None else None

    def _embedding(self) -> Optional[Embedding]:
        return next((m for m in self if isinstance(m, Embedding)), None)

    def forward(self, value: Any) -> Any:
        if is_token_slice(value):
            return self.forward_slice(value)
        return super().forward(value)

    def forward_slice(self, value: dict) -> Any:
        x, seq, pos = value["x"], int(value["seq"].reshape(-1)[0]), int(value["pos"].reshape(-1)[0])
        context = self._context(seq, pos)
        h, own = x, []
        for layer in self:
            if isinstance(layer, Embedding):
                h = layer(h, offset=pos)
            elif isinstance(layer, Block):
                h, k, v = layer.forward_slice(h, *context.past(len(own) // 2))
                own += [k, v]
            else:
                h = layer(h)
        grad = torch.is_grad_enabled()
        index = context.add(own, x.shape[1], grad)
        if grad and own:
            h = _ContextGrad.apply(context, index, h, *own)
        if isinstance(self[-1], Head):
            return h
        return {"x": h, "seq": value["seq"], "pos": value["pos"]}

    def _context(self, seq: int, pos: int) -> _SequenceContext:
        if pos == 0:  # a new sequence: drop whatever an earlier step left under this key
            context = self._contexts[seq] = _SequenceContext(self._contexts, seq)
            return context
        context = self._contexts.get(seq)
        have = 0 if context is None else context.length
        if context is None or have != pos or context.backward_done:
            begun = " and has begun its backward" if context is not None and context.backward_done else ""
            raise RuntimeError(
                f"token slice at position {pos} of sequence {seq} arrived, but this stage holds "
                f"{have} earlier tokens of it{begun}; "
                "a sequence's slices run their forwards in order, before any of its backwards "
                "(Note [token-sliced order] in schedules/token_sliced.py)")
        return context


def gpt_stages(cfg: GPTConfig, num_stages: int, seed: int = 0) -> list[nn.Module]:
    """Cut a GPT into ``num_stages`` stages: the embedding joins the first, the head the last,
    blocks spread as evenly as possible.  Each stage is a ``GPTStage`` (an ``nn.Sequential``
    that also runs token slices, for ``schedule="terapipe"``)."""
    if num_stages < 1 or num_stages > cfg.n_layers:
        raise ValueError(f"num_stages must be in 1..n_layers ({cfg.n_layers}), got {num_stages}")
    torch.manual_seed(seed)
    blocks = [Block(cfg) for _ in range(cfg.n_layers)]
    emb, head = Embedding(cfg), Head(cfg)
    sizes = [cfg.n_layers // num_stages + (i < cfg.n_layers % num_stages) for i in range(num_stages)]
    stages, at = [], 0
    for i, n in enumerate(sizes):
        parts = ([emb] if i == 0 else []) + blocks[at:at + n] + ([head] if i == num_stages - 1 else [])
        stages.append(GPTStage(*parts))
        at += n
    return stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position (on the shards, for logits sharded over the
    vocabulary: Note [vocabulary-parallel loss] in mpmd/tensor_parallel/builtin.py)."""
    if isinstance(logits, DTensor):
        return vocab_parallel_cross_entropy(logits, targets)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def char_dataset(text: str, seq_len: int, batch_size: int, steps: int, seed: int = 0):
    """Random windows of ``text`` as (inputs, next-character targets) batches; returns (vocab, batches)."""
    vocab = sorted(set(text))
    if len(text) <= seq_len + 1:
        raise ValueError(f"text has {len(text)} characters; it must be longer than seq_len + 1 = {seq_len + 1}")
    ids = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=g)
        x = torch.stack([ids[s:s + seq_len] for s in starts])
        y = torch.stack([ids[s + 1:s + seq_len + 1] for s in starts])
        batches.append((x, y))
    return vocab, batches
