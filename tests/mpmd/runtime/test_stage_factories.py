"""Stages given as zero-argument factories (Note [stage factories] in actors/build.py): each
actor builds its own stages under the seed contract, so a factory pipeline is bit-identical
to the same stages built eagerly with ``mpmd.build_stages`` and equals single-process
training; the controller holds only the stages' structure (meta device), and measures
``schedule="auto"`` one stage at a time."""

from __future__ import annotations

import functools
import os
import weakref

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import mpmd
from actors.probes import trim_heap
from mpmd.models import Block as GPTBlock, Embedding, GPTConfig, GPTStage, Head as GPTHead

from tests.models import Block, Embed, Head, make_data, reference_train, sgd

STEPS, BATCH, MICROBATCHES = 3, 8, 4


def _factories(n: int, d: int = 8) -> list:
    """n >= 2 stage factories: an embedding, blocks, a head."""
    return [functools.partial(Embed, 6, d)] + [functools.partial(Block, d)] * (n - 2) + [functools.partial(Head, d, 3)]


def _self_seeded_block():
    torch.manual_seed(1234)  # a factory that seeds itself: the contract leaves the caller's state alone
    return Block(8)


def _self_seeded_head():
    torch.manual_seed(4321)
    return Head(8, 3)


def _train(stages, schedule: str, **options):
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu", **options) as pipe:
        losses = [pipe.step(x, y) for x, y in make_data(STEPS, BATCH * options.get("dp", 1))]
        return losses, pipe.state_dict()


CASES = {  # name -> (stage list (factories, a self-seeding one, a module mixed in), schedule, options)
    "1f1b": (lambda: _factories(2), "1f1b", {}),
    "interleaved": (lambda: _factories(4), "interleaved-1f1b", {"num_actors": 2, "seed": 5}),
    "dp2-mixed": (lambda: [Embed(6, 8), _self_seeded_head], "1f1b", {"dp": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_factories_equal_eager_stages_bit_for_bit_and_single_process(ray_session, case):
    make, schedule, options = CASES[case]
    given = make()
    eager = mpmd.build_stages(given, seed=options.get("seed", 0))
    losses, state = _train(given, schedule, **options)
    eager_losses, eager_state = _train(eager, schedule, **options)
    assert losses == eager_losses
    assert list(state) == list(eager_state)
    for key, value in eager_state.items():
        assert torch.equal(state[key], value), key
    dp = options.get("dp", 1)
    model, ref_losses = reference_train(eager, make_data(STEPS, BATCH * dp), num_microbatches=MICROBATCHES * dp,
                                        loss_fn=F.mse_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    init = nn.Sequential(*eager).state_dict()
    assert any(not torch.equal(init[k], state[k]) for k in init)  # training moved the parameters


def test_the_seed_contract():
    factories = _factories(3)
    before = torch.random.get_rng_state()
    a, b = mpmd.build_stages(factories, seed=0), mpmd.build_stages(factories, seed=0)
    assert torch.equal(torch.random.get_rng_state(), before)  # the caller's random state is unchanged
    assert all(torch.equal(x, y) for s, t in zip(a, b, strict=True)
               for x, y in zip(s.state_dict().values(), t.state_dict().values(), strict=True))
    other = mpmd.build_stages(factories, seed=1)
    assert not torch.equal(a[1].fc.weight, other[1].fc.weight)
    torch.manual_seed(mpmd.stage_seed(0, 1))  # stage 1 is built after manual_seed(stage_seed(seed, 1))
    assert torch.equal(a[1].fc.weight, Block(8).fc.weight)
    seeded = mpmd.build_stages([_self_seeded_block] * 2, seed=3)
    assert torch.equal(seeded[0].fc.weight, seeded[1].fc.weight)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _big_stage(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(depth)])


def test_the_controller_does_not_hold_the_model(ray_session):
    width, depth = 2048, 6  # 2 stages x 6 x 2048^2 float32: 201 MB
    model_bytes = 2 * depth * width * width * 4
    factories = [functools.partial(_big_stage, width, depth)] * 2

    def pipeline_growth(factories, width: int) -> int:
        """The controller's resident growth from before a Pipeline of ``factories`` starts to
        after its first step, the Pipeline still running."""
        before = _trimmed_rss()
        with mpmd.Pipeline(factories, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, device="cpu",
                           optimizer=lambda p: torch.optim.SGD(p, lr=1e-3)) as pipe:
            pipe.step(torch.randn(4, width), torch.randn(4, width))
            assert all(p.is_meta for s in pipe.engine.stages for p in s.parameters())
            return _rss() - before

    # The first Pipeline of a process grows it by about 40 MiB whatever the model (imports,
    # threads, Ray's client): a small one pays that first.
    first = pipeline_growth([functools.partial(_big_stage, 64, 1)] * 2, 64)
    factory_growth = pipeline_growth(factories, width)
    before = _trimmed_rss()
    eager = mpmd.build_stages(factories)  # the arm that must grow: building here costs the model's bytes
    eager_growth = _rss() - before
    del eager
    print(f"model {model_bytes / 2**20:.0f} MiB; controller RSS growth: first pipeline {first / 2**20:.1f} MiB, "
          f"factories {factory_growth / 2**20:.1f} MiB, eager build {eager_growth / 2**20:.1f} MiB")
    assert eager_growth >= 0.75 * model_bytes  # a margin for what the kernel pages in lazily
    assert factory_growth < 0.05 * model_bytes  # 0.3-0.7 MiB measured


def _trimmed_rss() -> int:
    """The resident size once the heap's free pages are back with the kernel: pages freed by
    earlier tests in this process would be reused without growing it (an eager build after a
    freed model's worth grew it by 32 of 192 MiB), so growth from here is what is allocated."""
    trim_heap()
    return _rss()


def test_bad_factories_are_refused_before_any_actor_starts():
    def make(stages):
        return mpmd.Pipeline(stages, loss_fn=F.mse_loss, device="cpu", address="ray://nowhere:1")  # never reached

    with pytest.raises(ValueError, match=r"stages\[1\] is a factory that takes arguments \(d\).*functools.partial"):
        make([_factories(2)[0], lambda d: Block(d)])
    with pytest.raises(ValueError, match=r"stages\[1\]'s factory returned a dict, not an nn.Module"):
        make([_factories(2)[0], lambda: {"fc": Block(8)}])

    def broken():
        raise RuntimeError("no such checkpoint file")

    with pytest.raises(ValueError, match=r"stages\[0\]'s factory raised on the controller.*no such checkpoint file"):
        make([broken, _factories(2)[1]])
    with pytest.raises(ValueError, match=r"stages\[1\] is a int, not an nn.Module or a zero-argument factory"):
        make([_factories(2)[0], 3])
    shared = Block(8)
    with pytest.raises(ValueError, match=r"stages 0 and 1 share a parameter.*stage 0 is a factory"), \
            pytest.warns(UserWarning, match="exist outside the call"):
        make([lambda: shared, shared])
    cfg = GPTConfig(vocab_size=16, seq_len=16, d_model=16, n_layers=2)
    gpt = [lambda: GPTStage(Embedding(cfg), GPTBlock(cfg)), lambda: GPTStage(GPTBlock(cfg), GPTHead(cfg))]
    with pytest.raises(ValueError, match=r"token_slices='auto'.*stage factories.*a number of slices"):
        mpmd.Pipeline(gpt, schedule="terapipe", device="cpu", address="ray://nowhere:1")


def _fails_off_meta():
    block = Block(8)
    if not block.fc.weight.is_meta:
        raise RuntimeError("this node has no weights file")
    return block


def test_a_factory_failing_on_an_actor_names_the_stage_and_the_actor(ray_session):
    with pytest.raises(mpmd.PipelineError, match=r"building stage 1 from its factory failed on actor 1.*"
                                                  r"no weights file"):
        mpmd.Pipeline([_factories(2)[0], _fails_off_meta], loss_fn=F.mse_loss, device="cpu")


_LIVE: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
_PEAK = [0]


def _tracked(make):
    module = make()
    if not any(p.is_meta for p in module.parameters()):
        _LIVE.add(module)
        _PEAK[0] = max(_PEAK[0], len(_LIVE))
    return module


def test_auto_measures_one_stage_at_a_time(ray_session):
    factories = [functools.partial(_tracked, f) for f in _factories(4)]
    data = make_data(2, BATCH)
    _PEAK[0] = 0
    with mpmd.Pipeline(factories, schedule="auto", num_microbatches="auto", sample=data[0], loss_fn=F.mse_loss,
                       optimizer=sgd, device="cpu", num_actors=2) as pipe:
        assert _PEAK[0] == 1  # built (for real) on the controller one at a time, only to measure
        decision = pipe.auto_decision
        assert decision.chosen.fits and pipe.schedule.num_microbatches == decision.num_microbatches
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    model, ref_losses = reference_train(mpmd.build_stages(_factories(4)), data,
                                        num_microbatches=decision.num_microbatches, loss_fn=F.mse_loss, optimizer=sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


def test_checkpoints_and_restarts_with_factories(ray_session, tmp_path):
    data = make_data(4, BATCH)
    options = dict(schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd, device="cpu")
    with mpmd.Pipeline(_factories(3), **options) as pipe:
        for x, y in data[:2]:
            pipe.step(x, y)
        path = pipe.save(str(tmp_path / "ckpt"))
        pipe.engine.fleet.restart()  # fresh actors rebuild the stages from their factories, then load the state
        pipe.load(path)
        for x, y in data[2:]:
            pipe.step(x, y)
        state = pipe.state_dict()
    fresh = mpmd.Pipeline.load(path, stages=_factories(3), loss_fn=F.mse_loss, optimizer=sgd)
    with fresh:
        for x, y in data[2:]:
            fresh.step(x, y)
        assert all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
    model, _ = reference_train(mpmd.build_stages(_factories(3)), data, num_microbatches=MICROBATCHES,
                               loss_fn=F.mse_loss, optimizer=sgd)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")
    with pytest.raises(ValueError, match=r"does not fit stage 0 \(Embed\)"):
        mpmd.Pipeline.load(path, stages=_factories(3, d=16), loss_fn=F.mse_loss, optimizer=sgd)
