"""Context parallelism: a checkpoint written at cp=2 resumes at cp=1 (CP shards no parameter, so
the files are the same), a 4,096-token sequence at cp=2 trains like one process, and what CP
cannot run is refused before any actor starts or any step is sent, saying why."""

from __future__ import annotations

import pytest
import torch

import mpmd
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss
from mpmd.planning import causal_lm_loss

from tests.models import make_stages, reference_train, sgd


def _data(steps: int, batch: int, seq: int, vocab: int = 32):
    g = torch.Generator().manual_seed(11)
    return [(torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g))
            for _ in range(steps)]


def _assert_state(state, want, rtol=1e-4, atol=1e-5):
    assert list(state) == list(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=rtol, atol=atol, msg=lambda m: f"{key}: {m}")


def test_a_checkpoint_at_cp2_resumes_at_cp1(ray_session, tmp_path):
    cfg = GPTConfig(vocab_size=32, seq_len=16, d_model=16, n_heads=2, n_layers=2)
    data = _data(2, 4, 16)
    options = dict(loss_fn=lm_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b", num_actors=2, device="cpu")
    with mpmd.Pipeline(gpt_stages(cfg, 2), cp=2, **options) as pipe:
        first = pipe.step(*data[0])
        path = pipe.save(str(tmp_path / "ckpt"))
    with mpmd.Pipeline.load(path, stages=gpt_stages(cfg, 2), loss_fn=lm_loss, optimizer=sgd, device="cpu",
                            cp=1) as pipe:
        assert pipe.engine.config.layout.cp == 1 and len(pipe.actors) == 2
        second = pipe.step(*data[1])
        state = pipe.state_dict()
    model, ref_losses = reference_train(gpt_stages(cfg, 2), data, 2, lm_loss, sgd)
    torch.testing.assert_close(torch.tensor([first, second]), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_state(state, model.state_dict())


def test_a_4096_token_sequence_at_cp2_trains_like_one_process(ray_session):
    cfg = GPTConfig(vocab_size=32, seq_len=4096, d_model=8, n_heads=2, n_layers=1)
    data = _data(1, 2, 4096)
    with mpmd.Pipeline(gpt_stages(cfg, 1), loss_fn=lm_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b",
                       num_actors=1, cp=2, device="cpu") as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref_losses = reference_train(gpt_stages(cfg, 1), data, 2, lm_loss, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    _assert_state(state, model.state_dict())


def _gpt(seq: int = 16):
    return gpt_stages(GPTConfig(vocab_size=32, seq_len=seq, d_model=16, n_heads=2, n_layers=2), 2)


@pytest.mark.parametrize("stages, options, match", [
    (lambda: make_stages(2), dict(cp=2), "stage 0's attention cannot be sharded: .*supports_context_parallel"),
    (_gpt, dict(cp=2, schedule="terapipe"), "TeraPipe"),
    (_gpt, dict(cp=2, tp=(1, 2), tp_plan="auto"), "planner does not model context parallelism"),
    (_gpt, dict(cp=0), "cp must be"),
    (_gpt, dict(cp=2, schedule="auto"), "planner does not model context parallelism"),
    (_gpt, dict(cp=2, loss_fn=causal_lm_loss), "shifts the labels"),
], ids=["no-attention-hook", "terapipe", "tp-choices", "cp0", "auto", "shifting-loss"])
def test_what_cp_cannot_run_is_refused_before_actors_start(stages, options, match):
    options = {"loss_fn": lm_loss, "optimizer": sgd, "num_actors": 2, "device": "cpu", **options}
    with pytest.raises(ValueError, match=match):
        mpmd.Pipeline(stages(), **options)


def test_a_sliding_window_llama_is_refused():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=1, sliding_window=4,
                                     layer_types=["sliding_attention"] * 2)
    stages = mpmd.split(transformers.MistralForCausalLM(cfg), num_stages=2, verbose=False)
    with pytest.raises(ValueError, match="sliding-window"):
        mpmd.Pipeline(stages, loss_fn=lm_loss, optimizer=sgd, num_actors=2, cp=2, device="cpu")


def test_bad_steps_are_refused_before_anything_is_sent(ray_session):
    with mpmd.Pipeline(_gpt(), loss_fn=lm_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b", num_actors=2,
                       cp=2, device="cpu") as pipe:
        x, y = _data(1, 4, 14)[0]
        with pytest.raises(ValueError, match=r"14 tokens.*divisible by 2\*cp = 4.*e.g. 12 or 16"):
            pipe.step(x, y)
        x, y = _data(1, 4, 16)[0]
        with pytest.raises(ValueError, match="attention_mask"):
            pipe.step(x, y, attention_mask=torch.ones(4, 16))
        assert pipe.step(x, y) > 0  # the pipeline is still whole
    with mpmd.Pipeline(_gpt(), loss_fn=lm_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b", num_actors=2,
                       document_mask=True, device="cpu") as pipe:
        with pytest.raises(ValueError, match="position_ids"):
            pipe.step(x, y)
