"""Context parallelism's core (Note [zigzag sharding], Note [ring attention] in actors/context.py):
ring attention in two gloo processes against full attention over the whole sequence in one,
forward and backward, float32; the sharding and its causal work balance."""

from __future__ import annotations

import math

import pytest
import torch

from actors.context import (causal_pairs_per_rank, check_sequence_length, contiguous_indices, document_ids,
                            ring_attention, shard_sequence, unshard_sequence, zigzag_indices)

from tests.gloo import run_ranks

CP = 2
# name: (batch, query heads, K/V heads, tokens, head size, documents, layout, tile)
CASES = {
    "causal": (2, 2, 2, 16, 4, None, "zigzag", 512),
    "gqa_documents": (2, 4, 2, 32, 8, "random", "zigzag", 512),
    "masked_blocks": (1, 2, 1, 16, 4, "blocks", "zigzag", 512),  # no document crosses the ranks
    "contiguous": (1, 2, 2, 16, 4, None, "contiguous", 512),  # rank 0 sees none of rank 1's keys
    "tiled": (2, 4, 2, 48, 4, "random", "zigzag", 5),  # 12-token chunks in 5x5 tiles, ragged at the edge
}


def _case(name: str):
    """The whole sequence's q, k, v, output weights and document ids of a case (same on every process)."""
    b, hq, hkv, s, d, docs = CASES[name][:6]
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hkv, hkv))
    weights = torch.randn(b, hq, s, d, generator=g)
    if docs == "random":  # each row its own documents: a boundary before ~1 token in 5
        doc_ids = (torch.rand(b, s, generator=g) < 0.2).long().cumsum(dim=1)
    elif docs == "blocks":  # rank 0 holds tokens 0-3 and 12-15, rank 1 tokens 4-11: three documents
        doc_ids = torch.tensor([0] * 4 + [1] * 8 + [2] * 4).expand(b, s)
    else:
        doc_ids = None
    return q, k, v, weights, doc_ids


def _indices(name: str, rank: int) -> torch.Tensor:
    s, layout = CASES[name][3], CASES[name][6]
    return (zigzag_indices if layout == "zigzag" else contiguous_indices)(s, CP, rank)


def _full_attention(q, k, v, doc_ids=None):
    """Plain softmax attention over the whole sequence: causal, within documents, GQA by repeat."""
    s, rep = q.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    allowed = torch.ones(s, s, dtype=torch.bool).tril()
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, None, :, None] == doc_ids[:, None, None, :])
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1) @ v


def _worker(rank: int, group) -> dict:
    results = {}
    for name in CASES:
        idx = _indices(name, rank)
        q, k, v, weights, doc_ids = (None if t is None else t.index_select(-2 if t.dim() == 4 else -1, idx)
                                     for t in _case(name))
        q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = ring_attention(q, k, v, group, idx, doc_ids, tile=CASES[name][7])
        (y * weights).sum().backward()
        own = {q.data_ptr(), k.data_ptr(), v.data_ptr(), y.data_ptr()}
        results[name] = {"y": y.detach(), "grads": [t.grad for t in (q, k, v)],
                         "saved_shapes": [tuple(t.shape) for t in saved],
                         "saved_bytes": sum(t.numel() * t.element_size() for t in saved),
                         "own_saved": sum(t.data_ptr() in own for t in saved)}
    return results


@pytest.fixture(scope="module")
def two_ranks() -> dict:
    return run_ranks(_worker, CP, threads=1)


def _unshard(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    if CASES[name][6] == "zigzag":
        return unshard_sequence(shards, 2, CP)
    return torch.cat(shards, dim=2)


@pytest.mark.parametrize("name", list(CASES))
def test_ring_attention_equals_full_attention_forward_and_backward(two_ranks, name):
    q, k, v, weights, doc_ids = _case(name)
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    y = _full_attention(q, k, v, doc_ids)
    (y * weights).sum().backward()
    got = [two_ranks[r][name] for r in range(CP)]
    torch.testing.assert_close(_unshard(name, [g["y"] for g in got]), y.detach(), rtol=1e-5, atol=1e-6)
    for i, (label, whole) in enumerate(zip("qkv", (q, k, v))):
        torch.testing.assert_close(_unshard(name, [g["grads"][i] for g in got]), whole.grad,
                                   rtol=1e-5, atol=1e-6, msg=lambda m, label=label: f"d{label}: {m}")


def test_autograd_keeps_only_the_ranks_own_shard(two_ranks):
    b, hq, hkv, s, d = CASES["gqa_documents"][:5]
    shard = s // CP
    for rank in range(CP):
        got = two_ranks[rank]["gqa_documents"]
        # q, k, v, positions + document ids, output, log-sum-exp: nothing of the other rank's K/V
        assert sorted(got["saved_shapes"]) == sorted([(b, hq, shard, d), (b, hkv, shard, d), (b, hkv, shard, d),
                                                      (1 + b, shard), (b, hq, shard, d),
                                                      (b, hkv, hq // hkv, shard)])
        assert got["own_saved"] == 4  # q, k, v and the output are the rank's own tensors, not copies
        four = 4 * (2 * b * hq * shard * d + 2 * b * hkv * shard * d + b * hq * shard)
        assert got["saved_bytes"] == four + 8 * (1 + b) * shard


def test_one_shard_without_a_group_is_full_attention_with_documents():
    q, k, v, weights, doc_ids = _case("gqa_documents")
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ring = ring_attention(*leaves, None, torch.arange(q.shape[2]), doc_ids, tile=7)
    (ring * weights).sum().backward()
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    full = _full_attention(q, k, v, doc_ids)
    (full * weights).sum().backward()
    torch.testing.assert_close(ring, full, rtol=1e-5, atol=1e-6)
    for a, b in zip(leaves, (q, k, v)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


def test_a_token_alone_in_its_document_attends_to_itself_only():
    q, k, v = (torch.randn(1, 1, 4, 2, requires_grad=True) for _ in range(3))
    y = ring_attention(q, k, v, None, torch.arange(4), doc_ids=torch.tensor([0, 1, 1, 2]))
    y.sum().backward()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all() and torch.isfinite(v.grad).all()
    torch.testing.assert_close(y[0, 0, 0], v[0, 0, 0].detach())
    torch.testing.assert_close(y[0, 0, 3], v[0, 0, 3].detach())
    assert torch.equal(q.grad[0, 0, 0], torch.zeros(2))  # one key: the softmax does not depend on q


def test_document_ids_follow_positions_that_restart():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [3, 4, 0, 1, 2, 3, 4, 5]])  # row 2 starts mid-document
    assert document_ids(positions).tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 0, 1, 1, 1, 1, 1, 1]]


def test_zigzag_shards_round_trip_and_hold_head_and_tail():
    x = torch.arange(2 * 24).view(2, 24)
    shards = [shard_sequence(x, 1, 3, r) for r in range(3)]
    assert shards[0][0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]
    assert shards[2][0].tolist() == [8, 9, 10, 11, 12, 13, 14, 15]
    assert torch.equal(unshard_sequence(shards, 1, 3), x)
    assert torch.equal(shard_sequence(x, 1, 1, 0), x)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    for seq_len, cp in [(4096, 2), (4096, 4), (1024, 8)]:
        zigzag, contiguous = causal_pairs_per_rank(seq_len, cp), causal_pairs_per_rank(seq_len, cp, contiguous_indices)
        assert sum(zigzag) == sum(contiguous) == seq_len * (seq_len + 1) // 2
        assert max(zigzag) / (sum(zigzag) / cp) == 1.0  # head + tail: every rank the same
        assert max(contiguous) / (sum(contiguous) / cp) == pytest.approx(2 - 1 / cp, rel=2e-3)  # the last rank: 1.5x at cp=2


def test_a_length_zigzag_cannot_cut_is_refused():
    with pytest.raises(ValueError, match=r"sequence length 30 is not divisible by 2\*cp = 4 .* e.g. 28 or 32"):
        check_sequence_length(30, 2)
    with pytest.raises(ValueError, match="not divisible by 2\\*cp = 4"):
        shard_sequence(torch.zeros(1, 30), 1, 2, 0)
    with pytest.raises(ValueError, match="CP rank 2 is outside 0..1"):
        zigzag_indices(32, 2, 2)
    check_sequence_length(31, 1)  # one shard: any length


def test_mismatched_shapes_are_refused():
    q, k = torch.zeros(1, 3, 4, 2), torch.zeros(1, 2, 4, 2)
    with pytest.raises(ValueError, match=r"the K/V heads \(2\) divide the query heads \(3\)"):
        ring_attention(q, k, k, None, torch.arange(4))
    with pytest.raises(ValueError, match=r"positions must be \[4\]"):
        ring_attention(k, k, k, None, torch.arange(5))
