"""Hugging Face causal LMs split with ``mpmd.split`` train on actors exactly as the original
model trains in one process (gradient accumulation, SGD, float32): GPT-2 and Llama, tied
and untied LM heads, on 1F1B (2 stages), interleaved 1F1B and ZB-V (4 stages on 2
actors), and dp=2; the attention mask travels as a side input; the pipeline's state dict
has the model's own keys, and the tied copies stay bit-identical on every actor."""

from __future__ import annotations


import pytest
import ray
import torch

import mpmd
from mpmd.planning import causal_lm_loss

from tests.models import reference_train, sgd

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICROBATCHES, STEPS = 64, 8, 4, 3


def tiny(family: str, tied: bool):
    torch.manual_seed(0)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=4, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=SEQ,
                                   tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def batches(batch: int):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[0, :3] = 0  # left padding in one sequence, right padding in another
        mask[1, -2:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, labels, {"attention_mask": mask}))
    return out


def hf_forward(model, ids, side):
    return model(ids, attention_mask=side["attention_mask"], use_cache=False).logits


CASES = [(family, tied, schedule, stages)
         for family in ("gpt2", "llama") for tied in (True, False)
         for schedule, stages in (("1f1b", 2), ("interleaved-1f1b", 4), ("zbv", 4))]


def _id(case) -> str:
    family, tied, schedule, stages = case
    return f"{family}-{'tied' if tied else 'untied'}-{schedule}-{stages}"


@pytest.mark.parametrize("case", CASES + [("llama", True, "1f1b", 2, 2)], ids=lambda c: _id(c[:4]) + (
    f"-dp{c[4]}" if len(c) > 4 else ""))
def test_a_split_hugging_face_model_trains_as_the_model_does(ray_session, case):
    family, tied, schedule, num_stages = case[:4]
    dp = case[4] if len(case) > 4 else 1
    model = tiny(family, tied)
    data = batches(2 * MICROBATCHES * dp)
    ref_model, ref_losses = reference_train(None, data, MICROBATCHES * dp, causal_lm_loss, sgd, model=model,
                                            forward=hf_forward)
    stages = mpmd.split(model, num_stages=num_stages, verbose=False)
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=causal_lm_loss,
                       optimizer=sgd, num_actors=2, dp=dp, device="cpu") as pipe:
        assert bool(pipe.engine.ties) == tied
        losses = pipe.fit(data, progress=False)
        state = pipe.state_dict()
        if tied:  # the head's copy is the embedding's copy, bit for bit, on every actor
            copies = [w for part in ray.get([a.state_dict.remote() for a in pipe.actors])
                      for s, sd in part.items() for k, w in sd.items()
                      if k in ("lm_head.weight", "transformer.wte.weight", "model.embed_tokens.weight")]
            assert len(copies) == 2 * dp and all(torch.equal(c, copies[0]) for c in copies)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    want = ref_model.state_dict()
    assert sorted(state) == sorted(want), "the pipeline's state dict has the model's own keys"
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
