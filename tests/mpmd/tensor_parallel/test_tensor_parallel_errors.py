"""Tensor parallelism's refusals and its profile: what it cannot make equal to one process is
refused before a step, with a message that says what to do (Note [tensor parallelism] in
actors/tensor_parallel.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import mpmd
from mpmd.errors import PipelineError
from mpmd.planning import causal_lm_loss

from tests.fill_jobs import infer
from tests.models import reference_train, sgd
from tests.mpmd.tensor_parallel.test_tensor_parallel import batches, gpt_case, llama_case

OPTIONS = dict(num_microbatches=2, optimizer=sgd, device="cpu", tp=2, num_cpus=0.25)


def shard_tie_differently(stage_index, module, mesh):
    """A function plan whose embedding splits the hidden dimension while the head splits the vocabulary."""
    if stage_index == 0:
        parallelize_module(module, mesh, {"model.embed_tokens": ColwiseParallel()})
    else:
        parallelize_module(module, mesh, {"lm_head": ColwiseParallel()})


def test_a_tie_sharded_differently_on_its_stages_is_refused_before_a_step(ray_session):
    _, stages = llama_case(2, tied=True)
    with pytest.raises((ValueError, PipelineError), match="sharded differently"):
        mpmd.Pipeline(stages, loss_fn=causal_lm_loss, tp_plan=shard_tie_differently, **OPTIONS)


def test_a_plan_function_that_fails_names_the_stage(ray_session):
    def broken(stage_index, module, mesh):
        if stage_index == 1:
            raise KeyError("no such layer")

    stages, loss_fn, _ = gpt_case(2)
    with pytest.raises(PipelineError, match="tp_plan function failed on stage 1"):
        mpmd.Pipeline(stages, loss_fn=loss_fn, tp_plan=broken, **OPTIONS)


def test_a_dict_plan_applies_to_every_stage_that_has_the_module(ray_session):
    stages, loss_fn, vocab = gpt_case(2)  # stage 0's blocks are "1", "2"; stage 1's "0", "1"
    plan = {"1.mlp.0": ColwiseParallel(), "1.mlp.2": RowwiseParallel()}
    data = batches(vocab, 4, steps=2)
    with mpmd.Pipeline(copy.deepcopy(stages), loss_fn=loss_fn, tp_plan=plan, **OPTIONS) as pipe:
        losses = [pipe.step(x, y) for x, y in data]
        held = [m["params"] for m in pipe.engine.client.memory_bytes(what="memory")]
    whole = [sum(p.numel() * 4 for p in s.parameters()) for s in stages]
    mlp = [sum(p.numel() * 4 for n, p in s.named_parameters() if n.startswith("1.mlp.") and not n.endswith("2.bias"))
           for s in stages]
    for i, h in enumerate(held):  # exactly half of the planned MLP's bytes left each actor
        assert h == whole[i // 2] - mlp[i // 2] // 2
    ref, ref_losses = reference_train(stages, data, 2, loss_fn, sgd)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)


def test_the_profile_shows_each_tp_group_once_and_pipefill_and_terapipe_are_refused(ray_session):
    stages, loss_fn, vocab = gpt_case(2)
    with pytest.raises(ValueError, match="TeraPipe"):
        mpmd.Pipeline(stages, schedule="terapipe", token_slices=2, loss_fn=loss_fn, tp_plan="auto", **OPTIONS)
    x, y = batches(vocab, 4, steps=1)[0]
    with mpmd.Pipeline(stages, loss_fn=loss_fn, tp_plan="auto", **OPTIONS) as pipe:
        report = pipe.profile(x, y, steps=2)
        with pytest.raises(ValueError, match="PipeFill"):
            pipe.add_fill_job(mpmd.FillJob(fn=infer, data=[torch.zeros(4)] * 4))
    assert report.num_actors == 2  # TP rank 0 of each pipeline rank
    for r, held in enumerate(report.param_bytes):  # that actor's shards
        assert 0 < held < 0.75 * sum(p.numel() * 4 for p in stages[r].parameters())
