"""The built-in plans are numerically right: two gloo processes shard each stage by its
resolved plan (the actors' ``apply_plan``) and train it two SGD-with-momentum steps (two
microbatches each, gradients accumulated, then ``align_grads``; the foreach kernels CUDA
defaults to, through the actors' ``step``) beside the unsharded stage.  Outputs, the loss
and the input gradient (rtol 1e-5 / 1e-4), every parameter's gradient gathered from its
shards, the gradient norm summed from each actor's ``counted_here`` local gradients, and
every parameter after the steps (rtol 1e-4: row-parallel sums reorder additions) match.
No Ray; one spawn for all cases (tp_worker.py)."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch.multiprocessing as mp

from . import tp_worker

pytest.importorskip("transformers")

STAGE_CASES = [("llama_tied", 0), ("llama_tied", 1), ("llama_untied", 0), ("llama_untied", 1),
               ("llama_tied_one_stage", 0), ("qwen2_one_stage", 0), ("qwen3_one_stage", 0), ("gpt", 0), ("gpt", 1),
               ("llama_untied_loss_parallel", 1), ("llama_tied_one_stage_loss_parallel", 0), ("gpt_loss_parallel", 1),
]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "results.pkl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(tp_worker.main, args=(2, port, str(out)), nprocs=2, join=True)
    with open(out, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("case, stage", STAGE_CASES)
def test_sharded_stage_trains_as_the_whole_one(results, case, stage):
    got = results[case]
    assert "errors" not in got, got.get("errors")
    facts = got[stage]
    assert not facts["errors"], "\n".join(facts["errors"])
    # The test could not pass with nothing sharded: every planned weight is a DTensor, half as wide.
    assert facts["sharded"], "nothing was sharded"
    for name in facts["sharded"]:
        full, local = facts["full_shapes"][name], facts["local_shapes"][name]
        assert local == full or any(f == 2 * lo for f, lo in zip(full, local)), (name, full, local)
    assert any(facts["local_shapes"][n] != facts["full_shapes"][n] for n in facts["sharded"])
    if case.endswith("loss_parallel"):  # the logits stay a DTensor, sharded over the vocabulary, for the loss
        assert facts["output_type"] == "DTensor"
        assert facts["logits_local_shape"][-1] * 2 == facts["logits_shape"][-1]
    else:  # a plain tensor crosses to the next stage (or into the loss), not a DTensor
        assert facts["output_type"] == "Tensor"


def test_a_tied_embedding_and_head_in_one_stage_stay_one_parameter(results):
    assert results["llama_tied_one_stage"][0]["retied"]
    assert "lm_head.weight" not in results["llama_tied_one_stage"][0]["sharded"]  # listed once, as the embedding's


def test_llama_plan_shards_attention_mlp_embedding_and_head(results):
    first, last = results["llama_untied"][0]["sharded"], results["llama_untied"][1]["sharded"]
    assert "model.embed_tokens.weight" in first and "lm_head.weight" in last
    for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                 "mlp.up_proj", "mlp.down_proj"):
        assert f"model.layers.0.{proj}.weight" in first and f"model.layers.1.{proj}.weight" in last


def test_each_actor_shards_its_own_copy_so_a_group_must_build_the_same_weights(results):
    """The actors' apply_plan slices each shard from the actor's own copy (src_data_rank=None:
    no scatter) and leaves parameters outside the plan as built: an actor that built other
    weights keeps them, sharded and replicated alike (the same seed is what keeps a group equal)."""
    facts = results["source_rank"]
    assert "errors" not in facts, facts.get("errors")
    assert facts["sharded_own_slice"] is True
    assert facts["sharded_from_rank0"] is False
    assert facts["replicated_equal_rank0"] is False


def test_gradients_that_come_back_off_their_parameters_placements_are_aligned(results):
    """A vocabulary-parallel embedding's gradient comes back Replicate, the sequence-parallel
    norms' and Qwen3's per-head norms' Partial (Note [per-head norms]); align_grads lays them
    out (and the exactness and norm checks above ran on the aligned gradients)."""
    # the embedding and the layer's two norms; the layer's two norms and the final norm
    assert results["llama_untied"][0]["misaligned"] == 3 and results["llama_untied"][1]["misaligned"] == 3
    assert results["qwen3_one_stage"][0]["misaligned"] == 6  # and q_norm, k_norm
    assert results["gpt"][0]["misaligned"] == 1 and results["gpt"][1]["misaligned"] == 0


def test_a_tie_across_stages_reduces_shard_by_shard(results):
    """The first stage's vocabulary-parallel embedding and the last stage's colwise head hold
    the same rows on each TP rank: summing each rank's two local gradients is the tie reduction."""
    assert results["tie_reduce"]["errors"] == []


def test_the_vocabulary_parallel_loss_is_cross_entropy(results):
    assert results["loss_function"]["errors"] == []


def test_full_state_dicts_gather_and_load_at_any_tp(results):
    assert results["state"]["errors"] == []


def test_tp_collectives_predicts_what_torch_runs(results):
    """Per stage, the all-reduces and all-gathers counted by torch's CommDebugMode in the
    forward, the backward and align_grads are those tp_collectives reads from the plan."""
    for (case, stage), facts in results["collectives"].items():
        assert facts["ran"] == facts["predicted"], (case, stage)
    # Sequence-parallel blocks (Note [sequence parallelism]): attention's and the MLP's input gathered over
    # the sequence and their gradients reduce-scattered; o_proj's and down_proj's outputs reduce-scattered and
    # their gradients gathered; the head gathers its input and its logits.  Each norm's weight: one per step.
    assert results["collectives"][("llama", 1)]["ran"] == {
        ("forward", "all_gather"): 4, ("forward", "reduce_scatter"): 2, ("backward", "reduce_scatter"): 3,
        ("backward", "all_gather"): 3, ("per_step", "all_reduce"): 3}
    # Loss-parallel: the logits stay sharded; causal_lm_loss all-reduces each token's row maximum, then its
    # sum of exponentials and target logit (actors/vocab_loss.py).
    assert results["collectives"][("llama_loss_parallel", 1)]["ran"] == {
        ("forward", "all_gather"): 3, ("forward", "reduce_scatter"): 2, ("forward", "all_reduce"): 2,
        ("backward", "reduce_scatter"): 3, ("backward", "all_gather"): 3, ("per_step", "all_reduce"): 3}
