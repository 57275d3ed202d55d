"""Context parallelism on the grid with tensor parallelism and ZeRO-1, each equal to one process
(float32; losses rtol 1e-5, parameters rtol 1e-4 atol 1e-5): a Hugging Face Llama at tp=2 x cp=2
(each TP rank's ring carries its own heads' K/V over the CP group of its TP rank), and a GPT at
cp=2 with zero=1 (the optimizer state split over the dp x cp actors of a rank, Note [ZeRO-1
sharding] in actors/zero.py), whose checkpoint resumes at cp=1 equal to the uninterrupted run."""

from __future__ import annotations

import os

import pytest
import torch

import mpmd
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss

from tests.models import reference_train, sgd

VOCAB, SEQ = 48, 16


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def _tokens(steps: int, batch: int, vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x, y = (torch.randint(0, vocab, (batch, SEQ), generator=g) for _ in range(2))
        y[0, -3:] = -100  # a few targets do not count: the CP shards count different tokens
        out.append((x, y))
    return out


def _assert_state(state, want):
    assert sorted(state) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")


def test_llama_at_tp2_x_cp2_trains_like_one_process(ray_session):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)  # 4 query heads over 2 K/V heads: each TP rank rings its 2 over 1
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=True, attn_implementation="sdpa"))
    data = _tokens(2, 4, VOCAB, seed=7)
    ref_model, ref_losses = reference_train(None, data, 2, _loss, sgd, model=model,
                                            forward=lambda m, x, side: m(x, use_cache=False).logits)
    with mpmd.Pipeline(mpmd.split(model, num_stages=1, verbose=False), loss_fn=_loss, optimizer=sgd,
                       num_microbatches=2, schedule="1f1b", num_actors=1, cp=2, tp=2, tp_plan="auto",
                       device="cpu") as pipe:
        assert len(pipe.actors) == 4
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_state(state, ref_model.state_dict())


def test_zero1_at_cp2_shards_over_the_cp_ranks_and_resumes_at_cp1(ray_session, tmp_path):
    cfg = GPTConfig(vocab_size=32, seq_len=SEQ, d_model=16, n_heads=2, n_layers=2)
    data = _tokens(2, 4, 32, seed=11)
    options = dict(loss_fn=lm_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b", num_actors=1, device="cpu")
    with mpmd.Pipeline(gpt_stages(cfg, 1), cp=2, zero=1, **options) as pipe:
        first = pipe.step(*data[0])
        after_one = pipe.state_dict()
        path = pipe.save(str(tmp_path / "ckpt"))
    # one optimizer shard per CP rank (dp=1), each holding the momentum of some of the parameters
    shards = [torch.load(os.path.join(path, f"optim-0000-000{c}.pt"), weights_only=True)["state"] for c in (0, 1)]
    assert all(shards) and not set(shards[0]) & set(shards[1])
    with mpmd.Pipeline.load(path, stages=gpt_stages(cfg, 1), loss_fn=lm_loss, optimizer=sgd, device="cpu",
                            cp=1) as pipe:
        assert pipe.engine.config.layout.cp == 1 and len(pipe.actors) == 1
        second = pipe.step(*data[1])
        state = pipe.state_dict()
    _assert_state(after_one, reference_train(gpt_stages(cfg, 1), data[:1], 2, lm_loss, sgd)[0].state_dict())
    model, ref_losses = reference_train(gpt_stages(cfg, 1), data, 2, lm_loss, sgd)
    torch.testing.assert_close(torch.tensor([first, second]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_state(state, model.state_dict())
