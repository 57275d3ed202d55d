"""resolve_plans as data, in one process: wildcard expansion, the built-in plans, and every
refusal (Note [tensor-parallel plans] in mpmd/tensor_parallel/plans.py)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel)

from actors.tensor_parallel import install_rng_tracker
from mpmd.models import GPTConfig, gpt_stages
from mpmd.planning import partition
from mpmd.planning.hf import split_causal_lm
from mpmd.tensor_parallel import (Collective, TPCollectives, check_tied_placements, param_placements, resolve_plans,
                                  tp_collectives)

transformers = pytest.importorskip("transformers")

COL, ROW = ColwiseParallel(), RowwiseParallel()
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
         "mlp.up_proj", "mlp.down_proj")


def llama(balance=(2, 2), tied=False, family="llama", meta=False, **overrides):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=sum(balance),
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=tied)
    common.update(overrides)
    config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config,
              "mistral": transformers.MistralConfig}[family](**common)
    torch.manual_seed(0)
    with torch.device("meta" if meta else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return split_causal_lm(model, len(balance), list(balance), balancer=partition)[0]


def gpt(num_stages=2, meta=False, **cfg):
    with torch.device("meta" if meta else "cpu"):
        return gpt_stages(GPTConfig(**{"vocab_size": 64, "d_model": 32, "n_layers": 3, **cfg}), num_stages)


# -- tp=1, None, and what a plan may be ---------------------------------------------------------------
@pytest.mark.parametrize("plan", [None, "auto", {"nothing.here": COL}, lambda s, m, mesh: None])
def test_tp_1_shards_nothing_whatever_the_plan(plan):
    assert resolve_plans([nn.Linear(2, 2), nn.Linear(2, 2)], plan, 1) == [None, None]


def test_tp_above_1_needs_a_plan():
    with pytest.raises(ValueError, match=r"tp=2 needs a tp_plan.*tp_plan='auto'.*dict.*function"):
        resolve_plans(gpt(), None, 2)


@pytest.mark.parametrize("tp", [0, -1, 1.5, True])
def test_tp_must_be_a_positive_integer(tp):
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        resolve_plans(gpt(), "auto", tp)


def test_other_strings_and_single_styles_are_refused():
    with pytest.raises(ValueError, match=r"tp_plan='megatron' is not a plan; use tp_plan='auto'"):
        resolve_plans(gpt(), "megatron", 2)
    with pytest.raises(ValueError, match=r"is one style; give a dict naming the modules"):
        resolve_plans(gpt(), COL, 2)
    with pytest.raises(ValueError, match=r"tp_plan must be 'auto', a dict .* got int"):
        resolve_plans(gpt(), 3, 2)


# -- dict plans ---------------------------------------------------------------------------------------
def test_wildcards_expand_per_stage_to_concrete_names_in_the_dicts_order():
    stages = gpt()  # stage 0: embedding + blocks 0, 1; stage 1: block 2 + head
    plans = resolve_plans(stages, {"*.mlp.0": COL, "*.mlp.2": ROW, "*.tok": RowwiseParallel(input_layouts=Replicate())},
                          2)
    assert list(plans[0]) == ["1.mlp.0", "2.mlp.0", "1.mlp.2", "2.mlp.2", "0.tok"]
    assert list(plans[1]) == ["0.mlp.0", "0.mlp.2"]  # no embedding here: fewer entries
    assert plans[0]["1.mlp.0"] is COL


def test_hugging_face_layer_names_keep_the_models_indices():
    plans = resolve_plans(llama(), {"model.layers.*.mlp.gate_proj": COL, "lm_head": COL}, 2)
    assert list(plans[0]) == ["model.layers.0.mlp.gate_proj", "model.layers.1.mlp.gate_proj"]
    assert list(plans[1]) == ["model.layers.2.mlp.gate_proj", "model.layers.3.mlp.gate_proj", "lm_head"]


def test_a_stage_no_key_matches_gets_an_empty_plan():
    assert resolve_plans(gpt(), {"*.tok": RowwiseParallel()}, 2)[1] == {}


def test_the_empty_name_is_the_stage_itself():
    assert resolve_plans([nn.Linear(4, 6)], {"": COL}, 2) == [{"": COL}]


@pytest.mark.parametrize("key, hint", [("model.layers.*.mlp.gate_prj", r"model\.layers\.\*\.mlp\.gate_proj"),
                                       ("model.layer.0.self_attn.q_proj", r"model\.layers\.0\.self_attn\.q_proj"),
                                       ("lm_haed", r"lm_head")])
def test_a_key_matching_no_module_in_any_stage_names_the_closest(key, hint):
    with pytest.raises(ValueError, match=rf"tp_plan key '{key}' matches no module of any stage \(did you mean "
                                         rf"'{hint}'"):
        resolve_plans(llama(), {"model.layers.*.mlp.up_proj": COL, key: COL}, 2)


def test_two_keys_reaching_one_module_are_refused():
    with pytest.raises(ValueError, match=r"keys '\*\.mlp\.0' and '1\.mlp\.\*' both reach module '1\.mlp\.0'"):
        resolve_plans(gpt(), {"*.mlp.0": COL, "1.mlp.*": COL}, 2)


def test_values_must_be_parallel_styles_and_keys_names():
    with pytest.raises(ValueError, match=r"tp_plan\['1\.mlp\.0'\] is 'colwise', not a ParallelStyle"):
        resolve_plans(gpt(), {"1.mlp.0": "colwise"}, 2)
    with pytest.raises(ValueError, match=r"tp_plan key 3 is not a module name"):
        resolve_plans(gpt(), {3: COL}, 2)


def test_colwise_and_rowwise_take_only_linear_and_embedding():
    with pytest.raises(ValueError, match=r"stage 0, module '1\.ln1' \(LayerNorm with weight \(32,\)\): "
                                         r"ColwiseParallel shards only nn\.Linear and nn\.Embedding"):
        resolve_plans(gpt(), {"*.ln1": COL}, 2)
    with pytest.raises(ValueError, match=r"stage 1, module '0\.mlp' \(Sequential\): RowwiseParallel shards only"):
        resolve_plans(gpt(), {"0.mlp": ROW}, 2)


@pytest.mark.parametrize("style, module, field", [
    (COL, nn.Linear(8, 6), r"Linear\(in_features=8, out_features=6\)\): ColwiseParallel shards its out_features \(6\)"),
    (ROW, nn.Linear(6, 8), r"Linear\(in_features=6, out_features=8\)\): RowwiseParallel shards its in_features \(6\)"),
    (ROW, nn.Embedding(6, 8), r"Embedding\(num_embeddings=6, embedding_dim=8\)\): RowwiseParallel shards its "
                              r"num_embeddings \(6\)"),
    (COL, nn.Embedding(8, 6), r"Embedding\(num_embeddings=8, embedding_dim=6\)\): ColwiseParallel shards its "
                              r"embedding_dim \(6\)")])
def test_the_sharded_dimension_must_divide_by_tp(style, module, field):
    stage = nn.Sequential(nn.Identity(), module)
    with pytest.raises(ValueError, match=rf"stage 0, module '1' \({field} across tp=4 actors, but 6 is not divisible "
                                         rf"by 4; use a tp that divides 6.*leave '1' out of the plan"):
        resolve_plans([stage], {"1": style}, 4)
    assert resolve_plans([stage], {"1": style}, 3) == [{"1": style}]


def test_other_styles_pass_through_unchecked():
    styles = {"*.ln1": SequenceParallel(),
              "1": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate())}
    plans = resolve_plans(gpt(), styles, 2)
    assert list(plans[0]) == ["1.ln1", "2.ln1", "1"] and list(plans[1]) == ["0.ln1", "1"]


# -- function plans -----------------------------------------------------------------------------------
def test_a_function_plan_goes_to_every_stage_as_it_is():
    def shard(stage_index, module, mesh):
        pass
    assert resolve_plans(gpt(), shard, 2) == [shard, shard]


def test_a_function_that_cannot_take_three_arguments_is_refused():
    with pytest.raises(ValueError, match=r"tp_plan function .*cannot be called as \(stage_index, module, mesh\)"):
        resolve_plans(gpt(), lambda module, mesh: None, 2)


# -- tp_plan="auto" -----------------------------------------------------------------------------------
def test_auto_llama_plan():
    plans = resolve_plans(llama(), "auto", 2)
    first, last = plans
    assert list(first)[0] == "model.embed_tokens" and list(last)[-1] == "lm_head"
    blocks = ("self_attn", "mlp")  # their inputs prepared once: Note [one input-gradient all-reduce per block]
    norms = ("input_layernorm", "post_attention_layernorm")  # Note [sequence parallelism]
    layers = {f"model.layers.{i}.{p}" for i in (0, 1) for p in PROJS + blocks + norms}
    # layer 0 cuts the sequence, layer 1 gathers it back
    assert layers | {"model.layers.0", "model.layers.1"} == set(first) - {"model.embed_tokens"}
    layers = {f"model.layers.{i}.{p}" for i in (2, 3) for p in PROJS + blocks + norms}
    assert layers | {"model.layers.2", "model.norm"} == set(last) - {"lm_head"}
    attn = first["model.layers.0.self_attn"]
    assert type(attn) is PrepareModuleInput and not attn.use_local_output
    assert attn.input_kwarg_layouts == {"hidden_states": Shard(1)}  # gathered over the sequence
    assert first["model.layers.0"].desired_input_layouts == (Shard(1),)
    assert first["model.layers.1"].desired_output_layouts == (Replicate(),)  # the stage hands on whole values
    assert first["model.layers.0.self_attn.o_proj"].output_layouts == (Shard(1),)  # reduce-scattered
    assert type(last["model.norm"]) is SequenceParallel
    embed, head = first["model.embed_tokens"], last["lm_head"]
    assert type(embed) is RowwiseParallel and embed.input_layouts == (Replicate(),)  # vocabulary-parallel
    assert type(head) is ColwiseParallel and head.output_layouts == (Replicate(),)  # the loss sees full logits
    assert head.input_layouts == (Shard(1),)
    for i, kind in zip((0, 3, 4, 6), (ColwiseParallel, RowwiseParallel, ColwiseParallel, RowwiseParallel)):
        assert type(first[f"model.layers.0.{PROJS[i]}"]) is kind
    head = resolve_plans(llama(), "auto", 2, loss_parallel=True)[1]["lm_head"]
    assert head.output_layouts == (Shard(-1),) and not head.use_local_output  # Note [vocabulary-parallel loss]


def test_a_sequence_the_tp_ranks_cannot_cut_evenly_is_refused():
    from mpmd.tensor_parallel.builtin import SequenceShard, SequenceLengthCheck

    assert type(resolve_plans(llama(), "auto", 2)[0]["model.layers.0"]) is SequenceShard
    SequenceLengthCheck(2, 0)(None, (torch.zeros(1, 8, 4),))  # even: nothing to say
    with pytest.raises(ValueError, match=r"stage 0: .* 7 tokens, not divisible by 2; pad or cut sequences"):
        SequenceLengthCheck(2, 0)(None, (torch.zeros(1, 7, 4),))


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen3"])
def test_auto_plans_resolve_on_meta_stages(family):
    extra = {"head_dim": 8} if family == "qwen3" else {}
    plans = resolve_plans(llama(family=family, meta=True, **extra), "auto", 2)
    # the embedding, per layer 7 linears, 2 blocks, 2 norms (and Qwen3's 2 per-head norms), the edge layers
    assert len(plans[0]) == 1 + 2 * 11 + (4 if family == "qwen3" else 0) + 2
    meta, real = resolve_plans(gpt(meta=True), "auto", 2), resolve_plans(gpt(), "auto", 2)
    assert [list(p) for p in meta] == [list(p) for p in real]


def test_auto_qwen3_shards_its_per_head_norms_as_sequence_parallel_on_the_head_dim():
    plan = resolve_plans(llama(family="qwen3", head_dim=8), "auto", 2)[0]
    norm = plan["model.layers.0.self_attn.q_norm"]
    assert type(norm) is SequenceParallel and norm.sequence_sharding == (Shard(2),) and norm.use_local_output


@pytest.mark.parametrize("field, overrides", [
    ("num_attention_heads", dict(num_attention_heads=2, num_key_value_heads=2)),
    ("num_key_value_heads", dict(num_key_value_heads=1)),
    ("intermediate_size", dict(num_key_value_heads=4, intermediate_size=66)),
    ("vocab_size", dict(num_key_value_heads=4, vocab_size=66))])
def test_auto_llama_refuses_a_config_that_does_not_divide(field, overrides):
    with pytest.raises(ValueError, match=rf"stage 0: tp_plan='auto' shards LlamaConfig\.{field} \(\d+\) across tp=4 "
                                         rf"actors, but \d+ is not divisible by 4"):
        resolve_plans(llama(**overrides), "auto", 4)


def test_auto_gpt_plan_shards_mlp_embedding_and_head_and_leaves_attention():
    first, last = resolve_plans(gpt(), "auto", 2)
    assert list(first) == ["0.tok", "1.mlp.0", "1.mlp.2", "2.mlp.0", "2.mlp.2"]
    assert list(last) == ["0.mlp.0", "0.mlp.2", "1.out"]
    assert type(first["0.tok"]) is RowwiseParallel and first["0.tok"].input_layouts == (Replicate(),)
    assert type(last["1.out"]) is ColwiseParallel and last["1.out"].output_layouts == (Replicate(),)


def test_auto_gpt_refuses_a_vocabulary_that_does_not_divide():
    with pytest.raises(ValueError, match=r"stage 0: tp_plan='auto' shards GPTConfig\.vocab_size \(65\) across tp=2"):
        resolve_plans(gpt(vocab_size=65), "auto", 2)


def test_auto_refuses_hugging_face_gpt2_with_the_reason_and_what_to_pass():
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    stages = split_causal_lm(transformers.GPT2LMHeadModel(config), 2, None, balancer=partition)[0]
    with pytest.raises(ValueError, match=r"stage 0 is a GPT2Stage .* Conv1D .* Pass tp_plan as a dict .* or a "
                                         r"function"):
        resolve_plans(stages, "auto", 2)
    plans = resolve_plans(stages, {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                                   "lm_head": ColwiseParallel(output_layouts=Replicate())}, 2)  # what it suggests works
    assert list(plans[0]) == ["transformer.wte"] and list(plans[1]) == ["lm_head"]


def test_auto_refuses_a_class_it_has_no_plan_for():
    with pytest.raises(ValueError, match=r"stage 1 is a torch\.nn\.modules\.linear\.Linear, for which there is no "
                                         r"built-in tensor-parallel plan .* pass tp_plan as a dict .* or a function"):
        resolve_plans([gpt()[0], nn.Linear(2, 2)], "auto", 2)


# -- ties and pickling --------------------------------------------------------------------------------
def test_the_auto_plan_shards_a_tied_embedding_and_head_alike():
    stages = llama(tied=True)
    assert stages[0].model.embed_tokens.weight is stages[1].lm_head.weight
    plans = resolve_plans(stages, "auto", 2)
    assert param_placements(stages[0], plans[0])["model.embed_tokens.weight"] == "Shard(0)"
    assert param_placements(stages[1], plans[1])["lm_head.weight"] == "Shard(0)"


@pytest.mark.parametrize("plan, second", [({"lm_head": COL}, "Shard(0)"),
                                          ({"model.embed_tokens": COL, "lm_head": COL}, "Shard(0)")])
def test_a_plan_that_shards_a_tie_differently_is_refused(plan, second):
    with pytest.raises(ValueError, match=rf"stage 0's 'model\.embed_tokens\.weight' and stage 1's 'lm_head\.weight' "
                                         rf"are one tied parameter, but the plan places it as .* and "
                                         rf"{re.escape(second)}"):
        resolve_plans(llama(tied=True), plan, 2)
    resolve_plans(llama(tied=False), plan, 2)  # untied: nothing to agree


def test_tie_check_within_one_stage_and_unknown_styles():
    stage = llama(balance=(1,), tied=True)[0]
    check_tied_placements([stage], [{"model.embed_tokens": ROW, "lm_head": COL}])
    with pytest.raises(ValueError, match=r"stage 0's 'model\.embed_tokens\.weight' and stage 0's 'lm_head\.weight'"):
        check_tied_placements([stage], [{"model.embed_tokens": COL, "lm_head": COL}])
    check_tied_placements([stage], [{"model.embed_tokens": SequenceParallel(), "lm_head": COL}])  # unknown: not checked
    check_tied_placements([stage], [lambda s, m, mesh: None])


def test_resolved_plans_pickle():
    plans = resolve_plans(llama(family="qwen3", head_dim=8), "auto", 2) + resolve_plans(gpt(), "auto", 2)
    back = pickle.loads(pickle.dumps(plans))
    assert [{k: repr(v) for k, v in p.items()} for p in back] == [{k: repr(v) for k, v in p.items()} for p in plans]


# -- collectives ------------------------------------------------------------------------------------
def test_tp_collectives_of_the_auto_llama_plan():
    stages = llama()  # hidden 32, vocab 64: stage 0 embedding + 2 layers, stage 1 2 layers + head
    plans = resolve_plans(stages, "auto", 2)
    first, last = (tp_collectives(s, p) for s, p in zip(stages, plans))
    # forward: the embedding's all-reduce; per layer attention's and the MLP's inputs gathered over the
    # sequence and o_proj's and down_proj's outputs reduce-scattered (Note [sequence parallelism]); the
    # stage's output gathered whole.  Backward: the reverse of each, layer 0's input gradient gathered.
    # Per step: each norm weight's pending sum.
    assert first.counts() == {("forward", "all_reduce"): 1, ("forward", "all_gather"): 5,
                              ("forward", "reduce_scatter"): 4, ("backward", "reduce_scatter"): 4,
                              ("backward", "all_gather"): 5, ("per_step", "all_reduce"): 4}
    assert first.elements_per_token("forward") == 10 * 32 and first.elements_per_token("backward") == 9 * 32
    # the head gathers its input over the sequence and then the logits; its input gradient is reduce-scattered
    assert last.counts() == {("forward", "all_gather"): 6, ("forward", "reduce_scatter"): 4,
                             ("backward", "all_gather"): 5, ("backward", "reduce_scatter"): 5,
                             ("per_step", "all_reduce"): 5}
    assert last.forward[-1] == Collective("all_gather", "lm_head", 64)
    # loss_parallel: the logits stay sharded; the loss all-reduces the row maxima, then the sums and targets
    lp = tp_collectives(stages[1], resolve_plans(stages, "auto", 2, loss_parallel=True)[1])
    assert lp.forward[-2:] == (Collective("all_reduce", "lm_head (loss)", 1),
                               Collective("all_reduce", "lm_head (loss)", 2))
    assert not first.unknown and not last.unknown
    assert tp_collectives(stages[0], None) == TPCollectives()
    # a style not modelled is said so (its collectives are not counted)
    same = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Replicate(),))
    assert tp_collectives(stages[0], {"model.layers.0": same}).unknown


def test_dtensor_rng_tracker_is_made_at_start_up_without_a_world_broadcast(monkeypatch):
    """Left to DTensor, the first random op on a DTensor (dropout) makes the RNG tracker with a
    broadcast from rank 0 of the world group, which only the stage's actors reach (a hang on
    CUDA; DTensor keeps no tracker on the CPU, so its GPU check and the tracker are faked here)."""
    from torch.distributed.tensor import _random

    made = []

    class Tracker:
        def __init__(self, mesh, run_state_sync=True):
            made.append((mesh, run_state_sync))

    monkeypatch.setattr(_random, "OffsetBasedRNGTracker", Tracker)
    monkeypatch.setattr(_random, "is_rng_supported_mesh", lambda mesh: mesh == "cuda mesh")
    monkeypatch.setattr(_random, "_rng_tracker", None)
    install_rng_tracker("cpu mesh")
    assert made == []  # nothing to do where DTensor keeps no tracker
    install_rng_tracker("cuda mesh")
    install_rng_tracker("cuda mesh")  # one per process
    assert made == [("cuda mesh", False)]
