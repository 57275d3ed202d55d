"""mpmd.split on Hugging Face causal LMs: the chained stages compute the model's logits and
gradients, keep the model's state-dict keys and its tied head, and pickle; errors.

In one process, no Ray: tiny models built from configs (no weights are downloaded)."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch

import mpmd
from mpmd.planning import HF_CAUSAL_LMS, CausalLMStage, causal_lm_loss, partition

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, LAYERS = 96, 8, 4
FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "qwen3")
EXACT = dict(rtol=1e-5, atol=1e-6)


def _config(family: str, tied: bool, layers: int = LAYERS):
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                                       bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                       attn_pdrop=0.0, tie_word_embeddings=tied)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied)
    if family == "llama":
        return transformers.LlamaConfig(**common)
    if family == "mistral":  # every layer sliding-window, narrower than the sequence
        return transformers.MistralConfig(sliding_window=3, **common)
    if family == "qwen2":  # layers 2, 3 sliding-window, 0, 1 full: two mask kinds
        return transformers.Qwen2Config(use_sliding_window=True, sliding_window=3, max_window_layers=2, **common)
    return transformers.Qwen3Config(head_dim=8, **common)


def _model(family: str, tied: bool, attn: str = "sdpa", layers: int = LAYERS):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, tied, layers), attn_implementation=attn)
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=g)
    mask = torch.ones(3, SEQ, dtype=torch.long)
    mask[0, :3] = 0  # left padding
    mask[1, 5:] = 0  # right padding
    return ids, mask


def _chain(stages, x, **side):
    for stage in stages:
        x = stage(x, **side)
    return x


def _keys(module) -> set:
    return set(module.state_dict())


@pytest.mark.parametrize("num_stages", [2, 4])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", FAMILIES)
def test_stages_compute_the_models_logits_and_gradients(family, tied, num_stages):
    model = _model(family, tied)
    stages = mpmd.split(model, num_stages, verbose=False)
    assert len(stages) == num_stages and all(isinstance(s, CausalLMStage) for s in stages)
    ids, mask = _inputs()
    with torch.no_grad():
        for m in (None, mask):
            want = model(ids, attention_mask=m).logits
            got = _chain(stages, ids, attention_mask=m)
            assert got.shape == (3, SEQ, VOCAB)
            torch.testing.assert_close(got, want, **EXACT)

    labels = ids.masked_fill(mask == 0, -100)
    want_loss = model(ids, attention_mask=mask, labels=labels).loss
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = causal_lm_loss(_chain(stages, ids, attention_mask=mask), labels)
    loss.backward()
    torch.testing.assert_close(loss, want_loss, **EXACT)
    got = {n: p.grad for n, p in model.named_parameters()}  # the stages hold the model's own parameters
    assert set(got) == set(want) and all(g is not None for g in got.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], **EXACT, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
def test_both_attention_implementations(family, attn):
    model = _model(family, tied=True, attn=attn)
    stages = mpmd.split(model, 2, verbose=False)
    ids, mask = _inputs()
    with torch.no_grad():
        for m in (None, mask):
            torch.testing.assert_close(_chain(stages, ids, attention_mask=m),
                                       model(ids, attention_mask=m, use_cache=False).logits, **EXACT)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_position_ids_reach_every_stage(family):
    model = _model(family, tied=False)
    stages = mpmd.split(model, 3, verbose=False)
    ids, mask = _inputs()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # as generate() numbers left-padded rows
    with torch.no_grad():
        want = model(ids, attention_mask=mask, position_ids=positions, use_cache=False).logits
        got = _chain(stages, ids, attention_mask=mask, position_ids=positions)
    torch.testing.assert_close(got, want, **EXACT)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_state_dict_keys_are_the_models(family, tied):
    model = _model(family, tied)
    stages = mpmd.split(model, 3, verbose=False)
    full = model.state_dict()
    keys = [_keys(s) for s in stages]
    assert all(s.keeps_model_keys is True for s in stages)
    assert all(k <= set(full) for k in keys)
    assert set().union(*keys) == set(full)
    embed = "transformer.wte.weight" if family == "gpt2" else "model.embed_tokens.weight"
    head = "lm_head.weight"
    assert embed in keys[0] and head in keys[-1] and head not in keys[0] and embed not in keys[-1]
    shared = stages[0].state_dict()[embed].data_ptr() == stages[-1].state_dict()[head].data_ptr()
    assert shared is tied
    first = dict(stages[0].named_parameters())[embed]
    last = dict(stages[-1].named_parameters())[head]
    assert (first is last) is tied
    assert first is dict(model.named_parameters())[embed]
    # Only the ends overlap, and only through the tied parameter's two names.
    assert not keys[0] & keys[1] and not keys[1] & keys[2]

    merged = {k: v for s in stages for k, v in s.state_dict().items()}
    fresh = transformers.AutoModelForCausalLM.from_config(_config(family, tied)).eval()
    fresh.load_state_dict(merged, strict=True)
    ids, _ = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(fresh(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_every_llama_stage_owns_its_rotary_embedding():
    model = _model("llama", tied=True)
    stages = mpmd.split(model, 4, verbose=False)
    buffers = [s.model.rotary_emb.inv_freq for s in stages] + [model.model.rotary_emb.inv_freq]
    assert len({b.data_ptr() for b in buffers}) == len(buffers)
    for b in buffers:
        torch.testing.assert_close(b, buffers[-1], rtol=0, atol=0)
    assert all(s.model.rotary_emb.config is model.config for s in stages)


@pytest.mark.parametrize("family", ["gpt2", "qwen2"])
def test_stages_pickle(family):
    model = _model(family, tied=True)
    stages = mpmd.split(model, 2, verbose=False)
    restored = [pickle.loads(pickle.dumps(s)) for s in stages]
    assert [_keys(s) for s in restored] == [_keys(s) for s in stages]
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(_chain(restored, ids, attention_mask=mask),
                                   _chain(stages, ids, attention_mask=mask), rtol=0, atol=0)


def test_balance_params_is_the_min_max_with_the_ends():
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                                      num_attention_heads=4, tie_word_embeddings=False)
    model = transformers.AutoModelForCausalLM.from_config(config)  # embeddings and head each > a layer
    params = [sum(p.numel() for p in m.parameters()) for m in model.model.layers]
    costs = list(map(float, params))
    costs[0] += model.model.embed_tokens.weight.numel()
    costs[-1] += model.model.norm.weight.numel() + model.lm_head.weight.numel()
    stages = mpmd.split(model, 3, verbose=False)
    assert stages.layer_counts == partition(costs, 3)
    assert stages.layer_counts != [2, 2, 2]  # the embeddings and the head weigh on the ends
    assert stages.param_counts == [sum(p.numel() for p in s.parameters()) for s in stages]
    starts = [sum(stages.layer_counts[:i]) for i in range(3)]
    assert [s.layer_indices for s in stages] == [tuple(range(a, a + n)) for a, n in zip(starts, stages.layer_counts)]
    assert "decoder layers of LlamaForCausalLM" in stages.table and len(stages.table.splitlines()) == 5


def test_explicit_layer_counts():
    model = _model("gpt2", tied=True)
    stages = mpmd.split(model, balance=[1, 3], verbose=False)
    assert stages.layer_counts == [1, 3]
    assert [s.layer_indices for s in stages] == [(0,), (1, 2, 3)]
    assert {k.split(".")[2] for k in _keys(stages[1]) if k.startswith("transformer.h.")} == {"1", "2", "3"}
    one = mpmd.split(model, 1, verbose=False)
    ids, mask = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(one[0](ids, attention_mask=mask),
                                   model(ids, attention_mask=mask, use_cache=False).logits, **EXACT)


def test_too_many_stages_is_refused():
    with pytest.raises(ValueError, match=r"num_stages=5 is more than the 4 decoder layers of GPT2LMHeadModel.*<= 4"):
        mpmd.split(_model("gpt2", tied=True), 5, verbose=False)


@pytest.mark.parametrize("kwargs, match", [
    (dict(balance=[1, 2]), r"balance=\[1, 2\] covers 3 decoder layers but LlamaForCausalLM has 4"),
    (dict(balance=[2, 0, 2]), r"positive number of decoder layers"),
    (dict(num_stages=3, balance=[2, 2]), r"num_stages=3 but balance=\[2, 2\] lists 2 stages"),
    (dict(num_stages=2, balance="time"), r"balance='time' is not supported for a Hugging Face model"),
    (dict(), r"split needs num_stages for LlamaForCausalLM"),
    (dict(num_stages=0), r"num_stages must be a positive integer"),
])
def test_bad_balances_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mpmd.split(_model("llama", tied=True), verbose=False, **kwargs)


def test_unsupported_transformers_models_are_refused():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=64))
    with pytest.raises(ValueError, match=r"cannot cut .*BertModel.*GPT2LMHeadModel, LlamaForCausalLM.*"
                                         r"mpmd\.Pipeline\(\[stage0, stage1, \.\.\.\]"):
        mpmd.split(bert, 2, verbose=False)
    base = _model("llama", tied=True).model  # the decoder without its head
    with pytest.raises(ValueError, match=r"cannot cut .*LlamaModel"):
        mpmd.split(base, 2, verbose=False)
    assert set(HF_CAUSAL_LMS) >= {"GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                  "Qwen3ForCausalLM"}


def test_causal_lm_loss_is_transformers_loss():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(2, 5, VOCAB, generator=g)
    labels = torch.randint(0, VOCAB, (2, 5), generator=g)
    labels[0, 3] = -100
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1),
                                             ignore_index=-100)
    torch.testing.assert_close(causal_lm_loss(logits, labels), want, rtol=0, atol=0)
    from transformers.loss.loss_utils import ForCausalLMLoss

    torch.testing.assert_close(causal_lm_loss(logits, labels), ForCausalLMLoss(logits, labels, VOCAB), rtol=0, atol=0)


def test_importing_mpmd_does_not_import_transformers():
    code = "import sys, mpmd, mpmd.planning; assert 'transformers' not in sys.modules, 'transformers imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
