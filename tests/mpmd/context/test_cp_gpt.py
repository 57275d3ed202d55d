"""Context parallelism in the runtime: a GPT whose every microbatch's sequence is zigzag-sharded
over cp=2 actors per stage (ring attention, Note [context-parallel runtime] in
actors/cp_runtime.py) trains equal to one process on the whole sequences (float32; losses rtol
1e-5, parameters rtol 1e-4 atol 1e-5), with pp=1 and pp=2, with dp, and with targets that do not
all count (-100: the shards' losses are weighted by their counted tokens)."""

from __future__ import annotations

import pytest
import torch

import mpmd
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss

from tests.models import reference_train, sgd

SEQ = 16


def _data(steps: int, batch: int, seq: int = SEQ, vocab: int = 32, ignore: bool = False, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        y = torch.randint(0, vocab, (batch, seq), generator=g)
        if ignore:  # uneven counted tokens per shard: the first quarter of each sequence does not count
            y[:, : seq // 4] = -100
        out.append((x, y))
    return out


def _loss(logits, targets):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _train(cfg, stages, data, *, microbatches, **options):
    with mpmd.Pipeline(stages, loss_fn=_loss, optimizer=sgd, num_microbatches=microbatches, device="cpu",
                       **options) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        return losses, pipe.state_dict(), len(pipe.actors)


def _assert_like_reference(cfg, num_stages, data, microbatches, losses, state):
    model, ref_losses = reference_train(gpt_stages(cfg, num_stages), data, microbatches, _loss, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    ref = model.state_dict()
    assert list(state) == list(ref)
    for key, value in ref.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    init = torch.nn.Sequential(*gpt_stages(cfg, num_stages)).state_dict()
    assert any(not torch.equal(init[k], state[k]) for k in init)  # training moved them


@pytest.mark.parametrize("pp, schedule, dp, ignore", [(1, "1f1b", 1, False), (2, "1f1b", 1, True),
                                                      (2, "interleaved-1f1b", 1, False), (2, "gpipe", 2, False),
                                                      (2, "zbv", 1, False)],
                         ids=["cp2", "cp2-pp2-ignored-targets", "cp2-pp2-interleaved", "cp2-pp2-dp2",
                              "cp2-pp2-zbv-recompute"])
def test_gpt_at_cp2_trains_like_one_process(ray_session, pp, schedule, dp, ignore):
    num_stages = 4 if schedule in ("interleaved-1f1b", "zbv") else pp
    cfg = GPTConfig(vocab_size=32, seq_len=SEQ, d_model=16, n_heads=2, n_layers=max(2, num_stages))
    data = _data(2, 4 * dp, ignore=ignore)
    extra = {"recompute": True} if schedule == "zbv" else {}  # split backward (I, W) with the forward replayed at I
    losses, state, actors = _train(cfg, gpt_stages(cfg, num_stages), data, microbatches=2, schedule=schedule,
                                   num_actors=pp, cp=2, dp=dp, **extra)
    assert actors == pp * 2 * dp
    _assert_like_reference(cfg, num_stages, data, 2 * dp, losses, state)


def test_predict_and_evaluate_at_cp2_join_the_shards(ray_session):
    cfg = GPTConfig(vocab_size=32, seq_len=SEQ, d_model=16, n_heads=2, n_layers=2)
    (x, y), = _data(1, 4)
    with mpmd.Pipeline(gpt_stages(cfg, 2), loss_fn=_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b",
                       num_actors=2, cp=2, device="cpu") as pipe:
        logits, loss = pipe.predict(x), pipe.evaluate(x, y)
    model = torch.nn.Sequential(*gpt_stages(cfg, 2))
    with torch.no_grad():
        want = model(x)
    torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.tensor(loss), _loss(want, y), rtol=1e-5, atol=1e-6)


def test_a_cp2_pipeline_profiles_each_cp_group_by_its_rank_0(ray_session):
    cfg = GPTConfig(vocab_size=32, seq_len=SEQ, d_model=16, n_heads=2, n_layers=2)
    (x, y), = _data(1, 4)
    with mpmd.Pipeline(gpt_stages(cfg, 2), loss_fn=_loss, optimizer=sgd, num_microbatches=2, schedule="1f1b",
                       num_actors=2, cp=2, device="cpu") as pipe:
        report = pipe.profile(x, y, steps=1)
    assert len(report.busy_seconds) == 2 and all(b > 0 for b in report.busy_seconds)  # ranks 0 and 1 (CP rank 0)
    assert report.calibrated_step_seconds > 0
