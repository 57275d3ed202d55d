"""Context parallelism's core: a sequence sharded over the ``cp`` actors of a stage (zigzag, so
causal work is balanced) and exact causal attention across the shards (a ring of keys and values
with an online softmax, and a ring backward).  Pure torch and torch.distributed: gloo on CPU,
NCCL on GPU.  How the runtime uses it: docs/context.md.

Note [zigzag sharding]
~~~~~~~~~~~~~~~~~~~~~~
A sequence of ``S`` tokens (``S`` divisible by ``2C``) is cut in ``2C`` equal chunks; CP rank
``r`` holds chunks ``r`` and ``2C-1-r`` (head and tail), in that order.  Under a causal mask the
query at position ``p`` does ``p + 1`` units of work, so a rank holding an early and the mirrored
late chunk does the same work as every other (``causal_pairs_per_rank``: exactly equal; contiguous
shards at ``C = 2`` leave the last rank 1.5x the mean).  Everything per token (positions, RoPE
``position_ids``, document ids, the shifted labels) is sharded the same way, with
``shard_sequence`` on the whole sequence; ``zigzag_indices`` are the global positions a rank holds.

Note [ring attention]
~~~~~~~~~~~~~~~~~~~~~
``ring_attention`` computes, on each rank, its queries' attention over the keys and values (K/V)
of the whole sequence, exactly, holding at most two other ranks' K/V at a time and none after the
forward.  The C ranks form a ring; at step ``i`` rank ``r`` holds the K/V of rank ``r - i`` (with
their global positions and document ids), posts the send of them to ``r + 1`` and the receive of
``r - i - 1``'s from ``r - 1`` (P2P, ``batch_isend_irecv``, overlapped with the block's compute),
and computes one block by hand: scores ``q k^T * scale``, masked causally by GLOBAL positions and
to equal document ids, merged into a running max, sum and weighted value sum (online softmax).
A block is computed in tiles of at most ``tile`` x ``tile`` pairs (so the transient scores stay
tile-sized whatever the sequence); a tile's rows and columns that allow no pair are not computed,
nor a tile that allows none: under zigzag each rank then computes the same number of pairs
(Note [zigzag sharding]), about the causal half.  Rows a tile masks entirely contribute nothing
(max ``-inf`` merges as zero).  A row masked everywhere (impossible in causal self-attention: a
token sees itself) gives output 0 and log-sum-exp ``-inf``.

Why a ring and not an all-gather of K/V: the backward needs every K/V block again.  An all-gather
either keeps all C shards' K/V for the backward (each layer then keeps the whole sequence's K/V,
as at cp=1, and the per-actor activation target, cp=2 at <= 0.55x of cp=1, fails wherever K/V are
a fair part of the activations) or gathers them again.  The ring's backward (``_RingAttention.backward``) recomputes each block
from the log-sum-exp saved per query row, and sends the K/V around again with the dK/dV
accumulators one step behind them: each rank computes its queries' contribution to the K/V it
holds while that K/V's accumulator travels to it, adds the two and sends the sum on; after C hops
each accumulator is home.  So autograd keeps, per call, the rank's own
q, k, v, output, log-sum-exp and positions: one shard's worth (measured in
tests/actors/test_context.py).  Every rank of the group calls the same attentions in the same
order; the exchanges per call are C - 1 (forward) and 2C - 1 (backward) ring steps, each one send
and one receive per tensor.

Note [tile transients]: a tile's scores are ``[B, Hq, tile, tile]`` float32 whatever the
sequence, so at a long sequence they are the one part of the attention's memory that does not
shrink with the shard; the scores, their exponentials and the backward's ``dP`` are computed in
place (the forward holds one tile, the backward two) so that the transient stays small beside the
layer's activations (measured: ``python -m mpmd bench context``; cp=2's peak per actor is about
half cp=1's with the same tiles, docs/context.md).

GQA: ``q`` has ``Hq`` heads, ``k``/``v`` ``Hkv`` dividing ``Hq``; query head ``h`` reads K/V head
``h // (Hq / Hkv)`` (Hugging Face's ``repeat_kv``); K/V travel with ``Hkv`` heads.
"""

from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

__all__ = ["check_sequence_length", "zigzag_indices", "contiguous_indices", "shard_sequence",
           "unshard_sequence", "causal_pairs_per_rank", "document_ids", "ring_attention"]

_NEG_INF = float("-inf")


def check_sequence_length(seq_len: int, cp: int) -> None:
    """Refuse a sequence that zigzag sharding over ``cp`` ranks cannot cut (Note [zigzag sharding])."""
    if cp < 1:
        raise ValueError(f"cp must be at least 1, got {cp}")
    if cp > 1 and seq_len % (2 * cp):
        step = 2 * cp
        below, above = seq_len // step * step, (seq_len // step + 1) * step
        hint = f"{below} or {above}" if below else f"{above}"
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*cp = {step} (zigzag sharding cuts "
                         f"a sequence in 2*cp equal chunks); use a multiple of {step}, e.g. {hint}")


def _check_rank(cp: int, rank: int) -> None:
    if not 0 <= rank < cp:
        raise ValueError(f"CP rank {rank} is outside 0..{cp - 1} (cp={cp})")


def zigzag_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The global positions CP rank ``rank`` holds: chunks ``rank`` and ``2cp-1-rank`` of ``2cp``."""
    check_sequence_length(seq_len, cp)
    _check_rank(cp, rank)
    if cp == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * cp)
    tail = 2 * cp - 1 - rank
    return torch.cat([torch.arange(rank * chunk, (rank + 1) * chunk), torch.arange(tail * chunk, (tail + 1) * chunk)])


def contiguous_indices(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The positions of rank ``rank``'s contiguous shard (for comparison: its causal work is unbalanced)."""
    _check_rank(cp, rank)
    if seq_len % cp:
        raise ValueError(f"sequence length {seq_len} is not divisible by cp = {cp}")
    n = seq_len // cp
    return torch.arange(rank * n, (rank + 1) * n)


def shard_sequence(x: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s zigzag shard of ``x`` along ``dim`` (a copy: the whole may be freed)."""
    return x.index_select(dim, zigzag_indices(x.shape[dim], cp, rank).to(x.device))


def unshard_sequence(shards: Sequence[torch.Tensor], dim: int, cp: int) -> torch.Tensor:
    """The whole sequence from the ``cp`` ranks' zigzag shards, in rank order."""
    if len(shards) != cp:
        raise ValueError(f"unshard_sequence got {len(shards)} shards for cp={cp}; pass one per CP rank")
    if cp == 1:
        return shards[0]
    chunks: list = [None] * (2 * cp)
    for rank, shard in enumerate(shards):
        chunks[rank], chunks[2 * cp - 1 - rank] = shard.chunk(2, dim)
    return torch.cat(chunks, dim)


def causal_pairs_per_rank(seq_len: int, cp: int,
                          indices: Callable[[int, int, int], torch.Tensor] = zigzag_indices) -> list[int]:
    """Causal attention work per CP rank: its (query, key) pairs with key <= query, over the whole
    sequence (``indices`` = ``zigzag_indices`` or ``contiguous_indices``)."""
    return [int((indices(seq_len, cp, rank) + 1).sum()) for rank in range(cp)]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids of packed sequences from their positions, which restart at 0 at each document
    (``[..., S]`` -> same shape; the first document is 0).  Take them on the whole sequence, then
    shard them: a shard's positions alone do not show where a document began."""
    return (position_ids == 0).long().cumsum(dim=-1) - (position_ids[..., :1] == 0).long()


class _Ring:
    """The CP group as a ring: an exchange sends tensors to the next rank and receives, into new
    buffers of the same shapes, the previous rank's.  ``group=None``: one rank, no exchanges."""

    def __init__(self, group: Optional[dist.ProcessGroup]) -> None:
        self.group = group
        # gloo moves host tensors only: CUDA shards (actors sharing a GPU, the staged transport) go by host copies
        self.host = group is not None and dist.get_backend(group) == "gloo"
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.next_rank = self.prev_rank = None
        if self.size > 1:
            self.next_rank = dist.get_global_rank(group, (self.rank + 1) % self.size)
            self.prev_rank = dist.get_global_rank(group, (self.rank - 1) % self.size)

    def start(self, tensors: Sequence[torch.Tensor]) -> "_Exchange":
        device = tensors[0].device if tensors else None
        staged = self.host and device is not None and device.type == "cuda"
        sent = [(t.cpu() if staged else t).contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = ([dist.P2POp(dist.isend, t, self.next_rank, self.group) for t in sent]
               + [dist.P2POp(dist.irecv, t, self.prev_rank, self.group) for t in received])
        return _Exchange(dist.batch_isend_irecv(ops), sent, received, device if staged else None)


class _Exchange:
    """One ring step in flight; ``wait`` returns what arrived (on ``device`` again when staged)."""

    def __init__(self, works: list, sent: list[torch.Tensor], received: list[torch.Tensor],
                 device: Optional[torch.device] = None) -> None:
        self.works, self.sent, self.received = works, sent, received  # sent: alive until done
        self.device = device

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        if self.device is not None:
            return [t.to(self.device) for t in self.received]
        return self.received


def _block_mask(meta_q: torch.Tensor, meta_k: torch.Tensor) -> torch.Tensor:
    """Allowed (query, key) pairs, [D, s_q, s_k] (D = 1 or the batch): causal by global position
    (row 0 of ``meta``), same document (rows 1.. of ``meta``, when present)."""
    allowed = (meta_k[0][None, :] <= meta_q[0][:, None]).unsqueeze(0)
    if meta_q.shape[0] > 1:
        allowed = allowed & (meta_q[1:, :, None] == meta_k[1:, None, :])
    return allowed


Index = Union[slice, torch.Tensor]  # rows or columns of a tile: a range (a view) or a selection (a copy)


def _take(x: torch.Tensor, dim: int, index: Optional[Index]) -> torch.Tensor:
    if index is None:
        return x
    if isinstance(index, slice):
        return x.narrow(dim, index.start, index.stop - index.start)
    return x.index_select(dim, index)


def _put(x: torch.Tensor, dim: int, index: Index, value: torch.Tensor, add: bool = False) -> None:
    if isinstance(index, slice):
        target = x.narrow(dim, index.start, index.stop - index.start)
        target.add_(value) if add else target.copy_(value)
    else:
        x.index_add_(dim, index, value) if add else x.index_copy_(dim, index, value)


def _tiles(meta_q: torch.Tensor, meta_k: torch.Tensor, tile: int) -> Iterator[tuple[Index, Index, torch.Tensor]]:
    """A block's tiles of at most ``tile`` x ``tile`` (query, key) pairs that allow any pair, each as
    (query rows, key columns, mask [D, rows, columns]), trimmed to the rows and columns allowing any:
    what is computed (Note [ring attention]); the transient scores stay tile-sized."""
    for lo in range(0, meta_q.shape[1], tile):
        for klo in range(0, meta_k.shape[1], tile):
            allowed = _block_mask(meta_q[:, lo:lo + tile], meta_k[:, klo:klo + tile])
            rows, cols = allowed.any(dim=2).any(dim=0), allowed.any(dim=1).any(dim=0)
            if not bool(rows.any()):
                continue
            picked = []
            for flags, start in ((rows, lo), (cols, klo)):
                local = None if bool(flags.all()) else flags.nonzero().squeeze(1)
                picked.append((slice(start, start + flags.numel()) if local is None else local + start, local))
            (row_index, row_local), (col_index, col_local) = picked
            yield row_index, col_index, _take(_take(allowed, 1, row_local), 2, col_local)


def _scores(q5: torch.Tensor, k: torch.Tensor, rows: Index, cols: Index, mask: torch.Tensor,
            scale: float) -> torch.Tensor:
    """A tile's masked scores [B, Hkv, G, rows, cols] in float32, one new tensor (Note [tile transients])."""
    q_rows, k_cols = _take(q5, 3, rows).float(), _take(k, 2, cols).unsqueeze(2).float()  # bf16: fp32 scores
    scores = q_rows @ k_cols.transpose(-1, -2)
    return scores.mul_(scale).masked_fill_(~mask[:, None, None], _NEG_INF)


class _OnlineSoftmax:
    """Per query row: the running max, the sum of exp(score - max) and the value sum weighted by it."""

    def __init__(self, q5: torch.Tensor) -> None:
        self.max = torch.full(q5.shape[:-1], _NEG_INF, dtype=torch.float32, device=q5.device)
        self.sum = torch.zeros(q5.shape[:-1], dtype=torch.float32, device=q5.device)
        self.acc = torch.zeros(q5.shape, dtype=torch.float32, device=q5.device)

    def add(self, scores: torch.Tensor, v: torch.Tensor, rows: Index, cols: Index) -> None:
        old_max, old_sum, old_acc = (_take(t, 3, rows) for t in (self.max, self.sum, self.acc))
        new_max = torch.maximum(old_max, scores.amax(dim=-1))
        base = torch.where(new_max == _NEG_INF, 0.0, new_max)  # rows masked so far: everything weighs 0
        probs = scores.sub_(base.unsqueeze(-1)).exp_()  # in place: the scores are not read again
        rescale = torch.exp(old_max - base)
        new_sum = old_sum * rescale + probs.sum(dim=-1)
        new_acc = old_acc * rescale.unsqueeze(-1) + probs @ _take(v, 2, cols).unsqueeze(2).float()
        _put(self.max, 3, rows, new_max)
        _put(self.sum, 3, rows, new_sum)
        _put(self.acc, 3, rows, new_acc)

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(output [B, Hkv, G, s, D], log-sum-exp [B, Hkv, G, s]); rows with nothing allowed: 0, -inf."""
        seen = self.sum > 0
        out = torch.where(seen.unsqueeze(-1), self.acc / self.sum.clamp_min(1e-38).unsqueeze(-1), 0.0)
        lse = torch.where(seen, self.max + torch.log(self.sum.clamp_min(1e-38)), _NEG_INF)
        return out, lse


def _grouped(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    b, h, s, d = q.shape
    return q.reshape(b, kv_heads, h // kv_heads, s, d)


class _RingAttention(torch.autograd.Function):
    """Note [ring attention]: forward and the ring backward."""

    @staticmethod
    def forward(ctx, q, k, v, meta, ring: _Ring, scale: float, tile: int):
        q5 = _grouped(q, k.shape[1])
        state = _OnlineSoftmax(q5)
        blocks = [k, v, meta]
        for step in range(ring.size):
            exchange = ring.start(blocks) if step < ring.size - 1 else None
            for rows, cols, mask in _tiles(meta, blocks[2], tile):
                state.add(_scores(q5, blocks[0], rows, cols, mask, scale), blocks[1], rows, cols)
            if exchange is not None:
                blocks = exchange.wait()
        out5, lse = state.result()
        out = out5.reshape(q.shape).to(q.dtype)
        ctx.save_for_backward(q, k, v, meta, out, lse)
        ctx.ring, ctx.scale, ctx.tile = ring, scale, tile
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, meta, out, lse = ctx.saved_tensors
        ring, scale, tile = ctx.ring, ctx.scale, ctx.tile
        q5, dout5 = _grouped(q, k.shape[1]), _grouped(grad_out, k.shape[1]).float()
        delta = (dout5 * _grouped(out, k.shape[1]).float()).sum(dim=-1)  # rowsum(dO * O)
        base = torch.where(lse == _NEG_INF, 0.0, lse)
        dq5 = torch.zeros(q5.shape, dtype=torch.float32, device=q.device)
        blocks, in_flight = [k, v, meta], None
        for step in range(ring.size):
            exchange = ring.start(blocks) if step < ring.size - 1 else None
            grads = [torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                     torch.zeros(v.shape, dtype=torch.float32, device=v.device)]
            for rows, cols, mask in _tiles(meta, blocks[2], tile):
                _tile_backward(q5, blocks[0], blocks[1], rows, cols, mask, scale,
                               (_take(dout5, 3, rows), _take(delta, 3, rows), _take(base, 3, rows)), dq5, grads)
            if in_flight is not None:  # the held K/V's accumulator, which arrived during the compute
                grads = [mine + arrived for mine, arrived in zip(grads, in_flight.wait())]
            if ring.size > 1:  # the accumulators follow their K/V; after C hops each is home
                in_flight = ring.start(grads)
            if exchange is not None:
                blocks = exchange.wait()
        if in_flight is not None:
            grads = in_flight.wait()
        return (dq5.reshape(q.shape).to(q.dtype), grads[0].to(k.dtype), grads[1].to(v.dtype), None, None, None, None)


def _tile_backward(q5, k, v, rows, cols, mask, scale, row_terms, dq5, grads) -> None:
    """One tile's contribution to dq (added into ``dq5``) and to the held K/V's dK, dV."""
    dout, delta, base = row_terms
    probs = _scores(q5, k, rows, cols, mask, scale).sub_(base.unsqueeze(-1)).exp_()
    q_rows = _take(q5, 3, rows).float()
    k_cols, v_cols = (_take(t, 2, cols).unsqueeze(2).float() for t in (k, v))
    dv = (probs.transpose(-1, -2) @ dout).sum(dim=2)  # GQA: a K/V head sums its query heads
    dscores = (dout @ v_cols.transpose(-1, -2)).sub_(delta.unsqueeze(-1)).mul_(probs)  # two tiles alive at most
    _put(dq5, 3, rows, (dscores @ k_cols) * scale, add=True)
    _put(grads[0], 2, cols, (dscores.transpose(-1, -2) @ q_rows).sum(dim=2) * scale, add=True)
    _put(grads[1], 2, cols, dv, add=True)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Optional[dist.ProcessGroup],
                   positions: torch.Tensor, doc_ids: Optional[torch.Tensor] = None,
                   scale: Optional[float] = None, tile: int = 512) -> torch.Tensor:
    """Exact causal attention of this rank's queries over the whole sequence's keys and values
    (Note [ring attention]).  ``q`` [B, Hq, s, D], ``k``/``v`` [B, Hkv, s, D] (``Hkv`` divides
    ``Hq``), ``s`` = this rank's tokens; ``positions`` [s], their global positions (the mask is
    causal in them: ``zigzag_indices``); ``doc_ids`` [s] or [B, s], optional: attention only
    within a document.  ``scale`` defaults to 1/sqrt(D).  ``group``: the CP group (every member
    calls with its own shard), or None for one shard.  ``tile``: the most query rows and key
    columns computed at once (the transient scores are [B, Hq, tile, tile]).  Returns [B, Hq, s, D]."""
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(f"ring_attention wants q [B, Hq, s, D] and k, v [B, Hkv, s, D] alike; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    b, hq, s, d = q.shape
    if k.shape[0] != b or k.shape[2] != s or k.shape[3] != d or hq % k.shape[1]:
        raise ValueError(f"k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: the batch, tokens and head "
                         f"size must match and the K/V heads ({k.shape[1]}) divide the query heads ({hq})")
    if positions.shape != (s,):
        raise ValueError(f"positions must be [{s}] (one global position per token of the shard), got "
                         f"{tuple(positions.shape)}")
    rows = [positions.to(device=q.device, dtype=torch.long).unsqueeze(0)]
    if doc_ids is not None:
        docs = doc_ids if doc_ids.dim() == 2 else doc_ids.unsqueeze(0)
        if docs.shape[-1] != s or docs.shape[0] not in (1, b):
            raise ValueError(f"doc_ids must be [{s}] or [{b}, {s}], got {tuple(doc_ids.shape)}")
        rows.append(docs.to(device=q.device, dtype=torch.long))
    meta = torch.cat(rows)  # travels with the K/V: row 0 positions, rows 1.. document ids
    if tile < 1:
        raise ValueError(f"tile must be a positive number of tokens, got {tile}")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, meta, _Ring(group), scale, tile)
