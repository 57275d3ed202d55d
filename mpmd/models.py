"""Small models shipped with the package: a character-level GPT cut into stages."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["GPTConfig", "Embedding", "Block", "Head", "gpt_stages", "char_dataset", "lm_loss"]


class GPTConfig:
    def __init__(self, vocab_size: int = 64, seq_len: int = 64, d_model: int = 64, n_heads: int = 4,
                 n_layers: int = 4) -> None:
        if d_model % n_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.vocab_size, self.seq_len, self.d_model = vocab_size, seq_len, d_model
        self.n_heads, self.n_layers = n_heads, n_layers


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
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
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.proj((att @ v).transpose(1, 2).reshape(b, t, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_stages(cfg: GPTConfig, num_stages: int, seed: int = 0) -> list[nn.Module]:
    """Cut a GPT into ``num_stages`` stages: the embedding joins the first, the head the last,
    blocks spread as evenly as possible."""
    if num_stages < 1 or num_stages > cfg.n_layers:
        raise ValueError(f"num_stages must be in 1..n_layers ({cfg.n_layers}), got {num_stages}")
    torch.manual_seed(seed)
    blocks = [Block(cfg) for _ in range(cfg.n_layers)]
    emb, head = Embedding(cfg), Head(cfg)
    sizes = [cfg.n_layers // num_stages + (i < cfg.n_layers % num_stages) for i in range(num_stages)]
    stages, at = [], 0
    for i, n in enumerate(sizes):
        parts = ([emb] if i == 0 else []) + blocks[at:at + n] + ([head] if i == num_stages - 1 else [])
        stages.append(nn.Sequential(*parts))
        at += n
    return stages


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy over every position."""
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
