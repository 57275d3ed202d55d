"""mpmd.split(..., tp=T) and the TP profile it balances on (Note [TP balance] in
mpmd/planning/split.py, Note [TP cost model] in mpmd/planning/tp.py).  One process, no Ray."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import mpmd
from mpmd.models.gpt import Block, Embedding, GPTConfig, Head
import importlib

from mpmd.planning import Measurement
from mpmd.planning.tp import TPProfile, collective_seconds, tp_profile

split_module = importlib.import_module("mpmd.planning.split")
PLAN = {"*.lin": ColwiseParallel()}  # shards a layer's "lin" (stage-relative names), leaves "other" whole


class Sharded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(9, 10)  # 100 parameters, all sharded

    def forward(self, x):
        return x


class Whole(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.other = nn.Linear(11, 10)  # 120 parameters, none sharded

    def forward(self, x):
        return x


def _model() -> nn.Sequential:
    return nn.Sequential(Sharded(), Sharded(), Sharded(), Whole())


def test_tp_1_splits_as_before():
    for tp_plan in (PLAN, "auto", None):
        assert mpmd.split(_model(), 2, tp=1, tp_plan=tp_plan, verbose=False).layer_counts == \
            mpmd.split(_model(), 2, verbose=False).layer_counts == [2, 2]


def test_params_balance_per_tp_rank():
    """Per rank under tp=2: 50, 50, 50, 120, so [3, 1] (150 against 120) beats [2, 2] (100
    against 170); at tp=1 (100, 100, 100, 120) [2, 2] wins (200 against 220)."""
    stages = mpmd.split(_model(), 2, tp=2, tp_plan=PLAN, verbose=False)
    assert stages.layer_counts == [3, 1] and stages.tp == 2
    assert stages.param_counts == [300, 120] and stages.rank_param_counts == [150.0, 120.0]
    assert "per rank" in stages.table and "per rank of tp=2" in stages.table


def test_time_balance_divides_the_sharded_share_and_adds_the_collectives(monkeypatch):
    """balance='time' with measured layers (fixed here): a layer's time times (1 - share +
    share / T), plus its all-reduces (forward and backward) of its output's bytes."""
    def fake_chain(modules, sample, **_):
        return [Measurement(f=1.5 if isinstance(m, Whole) else 1.0, b=0.5, w=0.5,
                            full=1.5 if isinstance(m, Whole) else 1.0, act_bytes=0, out_bytes=1000, param_bytes=0)
                for m in modules]

    monkeypatch.setattr(split_module, "measure_chain", fake_chain)
    plan = {"*.lin": RowwiseParallel()}  # one all-reduce forward, none backward, per Sharded layer
    x = torch.zeros(1, 9)
    one = mpmd.split(_model(), 2, balance="time", sample=x, verbose=False, bytes_per_s=1e6)
    two = mpmd.split(_model(), 2, balance="time", sample=x, verbose=False, bytes_per_s=1e6, tp=2, tp_plan=plan)
    boundary = 2 * (mpmd.planning.DEFAULT_LATENCY_S["cpu"] + 1000 / 1e6)
    coll = collective_seconds(1000, 2, 1, mpmd.planning.DEFAULT_LATENCY_S["cpu"], 1e6)
    # Whole: 3 s; Sharded: 2 s, per rank of tp=2 1 s + coll.  [2, 2] at tp=1 (5 against 6 for [3, 1]).
    assert one.layer_counts == [2, 2] and one.predicted_s == pytest.approx([4 + boundary, 5 + boundary])
    assert two.layer_counts == [3, 1]  # 3.009 against 4.003 for [2, 2]
    assert two.predicted_s == pytest.approx([3 * (1 + coll) + boundary, 3 + boundary])


def test_auto_profile_of_the_demo_gpt():
    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    block = tp_profile(Block(cfg))  # the built-in plan: mlp.0 column-wise, mlp.2 row-wise; attention whole
    linears = sum(p.numel() for p in Block(cfg).mlp.parameters())
    assert (block.forward, block.backward, block.sharded) == (1, 1, linears)
    assert 0.5 < block.share < 1.0 and block.per_rank(2) == pytest.approx(block.params - linears / 2)
    emb = tp_profile(Embedding(cfg))  # the token table vocabulary-parallel: one all-reduce forward, none back
    assert (emb.forward, emb.backward, emb.sharded) == (1, 0, 64 * 16)
    head = tp_profile(Head(cfg))  # column-wise head: its input gradient all-reduced (the logits' gather not charged)
    assert (head.forward, head.backward) == (0, 1) and head.sharded == 16 * 64 + 64
    assert tp_profile(Block(cfg), None) == TPProfile(params=block.params)


def test_dict_plan_patterns_and_errors():
    model = _model()
    prof = tp_profile(model, {"*.lin": RowwiseParallel(), "3.other": ColwiseParallel()})
    assert (prof.forward, prof.backward, prof.sharded, prof.params) == (3, 1, 420, 420)  # rows forward, cols back
    assert tp_profile(model, {"lin": RowwiseParallel()}).sharded == 0  # names are the stage's: "0.lin"
    assert tp_profile(model[0], {"layers.*.lin": RowwiseParallel()}, layer=True).sharded == 100  # by its tail
    assert tp_profile(model[0], {"layers.*.lin": RowwiseParallel()}).sharded == 0  # a stage: exact names
    assert tp_profile(model, {"*": RowwiseParallel()}).sharded == 0  # the styles apply to linears, embeddings
    with pytest.raises(ValueError, match="tp_plan must be 'auto', a dict"):
        tp_profile(model, 3)
    with pytest.raises(ValueError, match="split's tp must be a positive integer"):
        mpmd.split(_model(), 2, tp=0)


def test_hugging_face_split_balances_per_rank():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg)
    one = mpmd.split(model, 2, verbose=False)
    two = mpmd.split(model, 2, tp=2, verbose=False)
    assert two.layer_counts == one.layer_counts  # the auto plan shards nearly all of every layer alike
    assert all(r < p * 0.6 for r, p in zip(two.rank_param_counts, two.param_counts))
