"""Tensor parallelism inside a stage (``Pipeline(..., tp=2, tp_plan="auto")``): every pipeline
rank is two actors holding DTensor shards of its stage, and training still equals one process
on the global batch (Note [tensor parallelism] in actors/tensor_parallel.py): losses to rtol
1e-5, every parameter to rtol 1e-4 (a row-parallel layer sums its shards' partial products in
another order), with an active gradient clip and an LR schedule, on the demo GPT and on HF
Llama (tied and untied), 1F1B, interleaved 1F1B and ZB-V, dp 1 and 2, and zero=1, with the
optimizers' for-loop kernels (CPU's default) and their foreach kernels (CUDA's)."""

from __future__ import annotations

import copy

import pytest
import ray
import torch

import mpmd
from mpmd.models import GPTConfig, gpt_stages, lm_loss
from mpmd.planning import causal_lm_loss

from tests.models import reference_records, reference_train, sgd

MICROBATCHES, STEPS, CLIP = 4, 3, 0.3


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: (step + 1) / STEPS)


def gpt_case(num_stages: int):
    cfg = GPTConfig(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=4)
    return gpt_stages(cfg, num_stages), lm_loss, 32


def llama_case(num_stages: int, tied: bool):
    """(the HF model, its stages): the reference trains the model itself."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                   tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(cfg)
    return model, mpmd.split(model, num_stages=num_stages)


def batches(vocab: int, batch: int, steps: int = STEPS, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, vocab, (batch, 8), generator=g), torch.randint(0, vocab, (batch, 8), generator=g))
            for _ in range(steps)]


def reference(stages, data, microbatches: int, loss_fn, optimizer, model=None):
    """``Reference`` with the same clip and LR schedule; the clip is active at every step."""
    model, records = reference_records(stages, data, microbatches, loss_fn, optimizer, model=model, clip=CLIP,
                                       lr_scheduler=warmup)
    assert all(r.grad_norm > CLIP for r in records)  # the clip is active
    return model, [r.loss for r in records]


def train(stages, data, loss_fn, optimizer, predict=None, **options):
    with mpmd.Pipeline(copy.deepcopy(stages), num_microbatches=MICROBATCHES, loss_fn=loss_fn, optimizer=optimizer,
                       lr_scheduler=warmup, clip_grad_norm=CLIP, device="cpu", tp=2, tp_plan="auto", num_cpus=0.25,
                       **options) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        held = ray.get([a.memory_bytes.remote() for a in pipe.actors])
        predicted = pipe.predict(predict) if predict is not None else None
        return losses, pipe.state_dict(), held, predicted


def assert_close(losses, state, ref, ref_losses) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    want = ref.state_dict()
    assert list(state) == list(want)  # nn.Sequential(*stages)'s keys, whole tensors
    for got, exp in zip(state.values(), want.values(), strict=True):
        torch.testing.assert_close(got, exp, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("schedule, num_stages, dp, zero, optimizer", [
    # SGD with momentum on the GPT: its attention's key bias has a zero gradient in exact arithmetic (softmax
    # ignores it), and Adam would turn each side's rounding noise there into full-size, different steps.
    # (1F1B at dp=1: the bf16 test below and test_tensor_parallel_errors.py; interleaved 1F1B and zero=1 on Llama)
    ("zbv", 4, 1, 0, sgd), ("1f1b", 2, 2, 0, sgd)])
def test_gpt_tp2_equals_single_process(ray_session, schedule, num_stages, dp, zero, optimizer):
    stages, loss_fn, vocab = gpt_case(num_stages)
    data = batches(vocab, 2 * MICROBATCHES * dp)
    losses, state, held, _ = train(stages, data, loss_fn, optimizer, schedule=schedule, dp=dp, zero=zero)
    ref, ref_losses = reference(stages, data, MICROBATCHES * dp, loss_fn, optimizer)
    assert_close(losses, state, ref, ref_losses)
    if schedule == "1f1b":  # the sharded layers are split in two: each actor holds much less than its stage
        assert len(held) == 4 * dp
        for i, h in enumerate(held):
            whole = sum(p.numel() * 4 for p in stages[(i // 2) % 2].parameters())
            assert h["params"] < 0.75 * whole


def sgd_foreach(params):
    """``sgd`` with the foreach kernels CUDA defaults to: Llama's norms stay plain beside DTensor
    weights, a mixed list those kernels refuse unless the actors step under implicit replication."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True)


def adamw_foreach(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01, foreach=True)


@pytest.mark.parametrize("tied, schedule, num_stages, dp, zero, optimizer, options", [
    # sequence-parallel norms (the built-in Llama plan), the vocabulary-parallel loss through a split
    # backward with recompute (its I and W halves under loss_parallel) and in predict's gathered logits
    (False, "zbv", 4, 1, 0, sgd_foreach, dict(loss_parallel=True, recompute=True)),
    (True, "interleaved-1f1b", 4, 1, 0, sgd, {}),
    (True, "1f1b", 2, 2, 1, adamw_foreach, dict(loss_parallel=True))])
def test_llama_tp2_equals_single_process(ray_session, tied, schedule, num_stages, dp, zero, optimizer, options):
    model, stages = llama_case(num_stages, tied)
    data = batches(64, 2 * MICROBATCHES * dp)
    probe = data[0][0]
    losses, state, _, predicted = train(stages, data, causal_lm_loss, optimizer, schedule=schedule, dp=dp, zero=zero,
                                        predict=probe, **options)
    ref, ref_losses = reference(None, data, MICROBATCHES * dp, causal_lm_loss, optimizer,
                                model=LogitsOnly(copy.deepcopy(model)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # the logits come back whole, also when the head left them sharded over the vocabulary
        torch.testing.assert_close(predicted, ref(probe), rtol=1e-4, atol=1e-5)
    want = ref.lm.state_dict()
    assert set(state) == set(want)  # the model's own keys, whole tensors
    for key, got in state.items():
        torch.testing.assert_close(got, want[key], rtol=1e-4, atol=1e-5)


class LogitsOnly(torch.nn.Module):
    def __init__(self, lm) -> None:
        super().__init__()
        self.lm = lm

    def forward(self, x):
        return self.lm(x, use_cache=False).logits


def test_bf16_and_recompute_under_tp_train_like_the_same_autocast_in_one_process(ray_session):
    """bf16 autocast (stage outputs handed on in bf16) and every stage recomputed in its backward,
    on the sharded stages: close to one process under the same autocast (bf16 tolerance: the
    row-parallel layers sum bf16 partial products)."""
    stages, loss_fn, vocab = gpt_case(2)
    data = batches(vocab, 2 * MICROBATCHES)
    with mpmd.Pipeline(copy.deepcopy(stages), num_microbatches=MICROBATCHES, loss_fn=loss_fn, optimizer=sgd,
                       device="cpu", tp=2, tp_plan="auto", num_cpus=0.25, precision="bf16", recompute=True) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref_losses = reference_train(stages, data, MICROBATCHES, loss_fn, sgd, precision="bf16")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-2, atol=1e-3)
    for (key, got), want in zip(state.items(), model.state_dict().values(), strict=True):
        assert got.dtype == torch.float32, key  # float32 masters
        torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3, msg=lambda m: f"{key}: {m}")
