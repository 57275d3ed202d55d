"""Note [sharded build] (actors/build.py): under TP, mpmd train's Llama factories build each
actor's shards directly (meta, then the plan, then only the shards materialised, each filled
from a whole tensor drawn as the unsharded build draws it), and the result equals slicing the
whole build bit for bit."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import mpmd
from mpmd.lm.config import ModelConfig
from mpmd.lm.models import LlamaStageFactory, layer_counts, llama_spec
from mpmd.planning import causal_lm_loss

from tests.models import sgd

pytest.importorskip("transformers")


@dataclasses.dataclass(frozen=True)
class Recorded(LlamaStageFactory):
    """Leaves a file when an actor builds its stage sharded (the test sees which path ran)."""

    marks: str = ""

    def build_sharded(self, shard, device):
        open(os.path.join(self.marks, f"stage-{self.index}-{os.getpid()}"), "w").close()
        return super().build_sharded(shard, device)


def test_tensor_parallel_factories_build_only_their_shards_and_equal_the_whole_build(ray_session, tmp_path):
    spec = llama_spec(ModelConfig(size="debug", hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                  intermediate_size=128), 96)
    counts = tuple(layer_counts(spec.num_layers, 2))
    factories = [Recorded(spec, counts, s, marks=str(tmp_path)) for s in range(2)]
    whole = mpmd.build_stages([LlamaStageFactory(spec, counts, s) for s in range(2)], seed=5)
    with mpmd.Pipeline(factories, schedule="1f1b", tp=2, tp_plan="auto", num_microbatches=2, seed=5,
                       loss_fn=causal_lm_loss, optimizer=sgd, device="cpu", num_cpus=0.25) as pipe:
        state = pipe.state_dict()
    assert len(os.listdir(tmp_path)) == 4  # every actor (2 stages x 2 TP ranks) built sharded
    want = {k: v for stage in whole for k, v in stage.state_dict().items()}
    assert set(state) == set(want)
    for key, value in state.items():
        assert torch.equal(value, want[key]), key
