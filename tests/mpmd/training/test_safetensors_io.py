"""Weights in and out as Hugging Face safetensors, the actors reading and writing their own parts
(Note [export from the actors], Note [weights from safetensors] in mpmd/training/export.py)."""
from __future__ import annotations

import copy

import pytest
import torch

import mpmd
from mpmd.planning import causal_lm_loss

from tests.models import sgd
from tests.mpmd.tensor_parallel.test_tensor_parallel import llama_case

transformers = pytest.importorskip("transformers")


def pretrained(cfg, seed: int):
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tied, tp, shard_size", [(True, 2, None), (False, 2, "40KB"), (False, 1, None)])
def test_a_pipeline_loads_a_save_pretrained_directory_actor_by_actor(ray_session, tmp_path, tied, tp, shard_size):
    """A model saved by ``save_pretrained`` (one file, or shards with an index; a tied head
    written once) loads into a pipeline built from another initialisation: every tensor equals
    the saved model's, and so do the logits."""
    model, stages = llama_case(2, tied=tied)
    other = pretrained(model.config, seed=7)
    other.save_pretrained(tmp_path, safe_serialization=True, **({"max_shard_size": shard_size} if shard_size else {}))
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with mpmd.Pipeline(copy.deepcopy(stages), schedule="1f1b", tp=tp, tp_plan="auto" if tp > 1 else None,
                       num_microbatches=2, loss_fn=causal_lm_loss, optimizer=sgd, device="cpu", num_cpus=0.25) as pipe:
        pipe.load_safetensors(tmp_path)
        state, logits = pipe.state_dict(), pipe.predict(ids)
    want = other.state_dict()
    assert set(state) == set(want)
    for key, value in state.items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(logits, other(ids).logits, rtol=1e-5, atol=1e-5)


def test_the_export_loads_back_and_a_wrong_directory_says_so(ray_session, tmp_path):
    """What ``export_safetensors`` writes is what ``load_safetensors`` reads; a directory of no
    model, or of a model of other shapes, is refused with what is wrong."""
    model, stages = llama_case(2, tied=False)
    small = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8)
    pretrained(small, seed=1).save_pretrained(tmp_path / "small", safe_serialization=True)
    with mpmd.Pipeline(copy.deepcopy(stages), schedule="1f1b", num_microbatches=2, loss_fn=causal_lm_loss,
                       optimizer=sgd, device="cpu", num_cpus=0.25) as pipe:
        before = pipe.state_dict()
        pipe.export_safetensors(tmp_path / "out")
        with torch.no_grad():
            pipe.load_state_dict({k: torch.zeros_like(v) for k, v in before.items()})
        pipe.load_safetensors(tmp_path / "out")
        after = pipe.state_dict()
        with pytest.raises(FileNotFoundError, match="neither model.safetensors.index.json nor model.safetensors"):
            pipe.load_safetensors(tmp_path)
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    with mpmd.Pipeline(copy.deepcopy(stages), schedule="1f1b", num_microbatches=2, loss_fn=causal_lm_loss,
                       optimizer=sgd, device="cpu", num_cpus=0.25) as pipe:
        with pytest.raises(ValueError, match=r"another model: 'model.embed_tokens.weight' in model.safetensors has "
                                             r"shape \(32, 32\), but stage 0's 'model.embed_tokens.weight' has shape "
                                             r"\(64, 32\); 'lm_head.weight' .* but stage 1's 'lm_head.weight' has shape \(64, 32\)$"):
            pipe.load_safetensors(tmp_path / "small")
        for key, value in pipe.state_dict().items():  # refused before any actor read: nothing changed
            assert torch.equal(value, before[key]), key
