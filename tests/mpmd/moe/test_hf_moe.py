"""Hugging Face mixture-of-experts models under ``mpmd.split`` (Note [Hugging Face MoE] in
mpmd/planning/hf_moe.py): a split Qwen3-MoE, Mixtral and DeepSeek-V3 train on actors exactly as
the model trains in one process (gradient accumulation, float32); weights load from the Hub's
one-tensor-per-expert files and from fused ones, and the export is what ``from_pretrained``
loads, with equal logits; what cannot run split is refused with the reason."""

from __future__ import annotations

import copy

import pytest
import torch

import mpmd
from mpmd.planning import causal_lm_loss
from mpmd.planning.hf_meta import MetaStageFactory

from actors.experts import hooks_of
from actors.hf_experts import hub_source
from mpmd.moe import attach, finish_step, loss_scale
from tests.models import Reference, reference_train, sgd

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, MICROBATCHES, STEPS = 64, 8, 4, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=2, max_position_embeddings=SEQ)


def tiny(family: str, seed: int = 0, **options):
    """A tiny model of ``family`` built from its config (nothing downloaded), eager experts."""
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=48, moe_intermediate_size=16, head_dim=16,
                                          num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                                          norm_topk_prob=True, mlp_only_layers=[3], **options)
        cls = transformers.Qwen3MoeForCausalLM
    elif family == "mixtral":
        cfg = transformers.MixtralConfig(**COMMON, intermediate_size=16, num_key_value_heads=1, num_local_experts=4,
                                         num_experts_per_tok=2, tie_word_embeddings=True, **options)
        cls = transformers.MixtralForCausalLM
    else:
        cfg = transformers.DeepseekV3Config(**COMMON, intermediate_size=48, moe_intermediate_size=16,
                                            num_key_value_heads=2, n_routed_experts=8, num_experts_per_tok=2,
                                            n_group=2, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16,
                                            q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                            **options)
        cls = transformers.DeepseekV3ForCausalLM
    model = cls._from_config(cfg, experts_implementation="eager")
    if family == "deepseek_v3":  # a router bias that changes the choice (aux-loss-free balancing has moved it)
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    return model


def batches(batch: int):
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        mask = torch.ones(batch, SEQ, dtype=torch.long)
        mask[0, :3] = 0
        labels = ids.masked_fill(mask == 0, -100)
        out.append((ids, labels, {"attention_mask": mask}))
    return out


def hf_forward(model, ids, side):
    return model(ids, attention_mask=side["attention_mask"], use_cache=False).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "deepseek_v3"])
def test_a_split_moe_model_trains_as_the_model_does(ray_session, family):
    model = tiny(family)
    data = batches(2 * MICROBATCHES)
    ref_model, ref_losses = reference_train(None, data, MICROBATCHES, causal_lm_loss, sgd, model=model,
                                            forward=hf_forward)
    stages = mpmd.split(model, num_stages=2, verbose=False)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=causal_lm_loss,
                       optimizer=sgd, num_actors=2, device="cpu", num_cpus=0.25) as pipe:
        losses = pipe.fit(data, progress=False)
        state = pipe.state_dict()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    want = ref_model.state_dict()
    assert sorted(state) == sorted(want), "the pipeline's state dict has the model's own keys"
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    moved = [k for k in want if "experts" in k and not torch.equal(want[k], model.state_dict()[k])]
    assert moved, "the experts trained"


def fused_files(model, directory) -> None:
    """``model``'s weights as its modules hold them (fused experts), in one safetensors file."""
    from safetensors.torch import save_file

    directory.mkdir()
    model.config.save_pretrained(directory)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def file_keys(directory) -> set:
    import json
    import os

    from safetensors import safe_open

    index = directory / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_weights_load_per_expert_or_fused_and_the_export_loads_in_transformers(ray_session, tmp_path, family):
    """A ``save_pretrained`` directory (the Hub's one tensor per expert: ``experts.<e>.gate_proj``
    / ``w1`` ...) and a fused one load into a split pipeline tensor for tensor; after a training
    step the export is in the layout ``save_pretrained`` writes, and ``from_pretrained`` loads it
    with the pipeline's weights and logits."""
    model, other = tiny(family), tiny(family, seed=7)
    other.save_pretrained(tmp_path / "hub", max_shard_size="40KB")
    hub_keys = file_keys(tmp_path / "hub")
    assert not any(k.endswith("gate_up_proj") for k in hub_keys) and any(".experts.3." in k for k in hub_keys)
    third = tiny(family, seed=9)
    fused_files(third, tmp_path / "fused")
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    stages = mpmd.split(copy.deepcopy(model), num_stages=2, verbose=False)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=causal_lm_loss, optimizer=sgd,
                       device="cpu", num_cpus=0.25) as pipe:
        for source, directory in ((other, "hub"), (third, "fused")):
            pipe.load_safetensors(tmp_path / directory)
            state, logits = pipe.state_dict(), pipe.predict(ids)
            want = source.state_dict()
            assert set(state) == set(want)
            for key, value in state.items():
                torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=lambda m: f"{directory} {key}: {m}")
            with torch.no_grad():
                torch.testing.assert_close(logits, source(ids).logits, rtol=1e-5, atol=1e-5)
        pipe.fit(batches(4)[:1], progress=False)
        pipe.export_safetensors(tmp_path / "out")
        trained, logits = pipe.state_dict(), pipe.predict(ids)
    # (a tied head is written under both its keys, as for dense models, unless skip= leaves it out)
    assert file_keys(tmp_path / "out") - {"lm_head.weight"} == hub_keys - {"lm_head.weight"}, \
        "the export is in save_pretrained's layout"
    model.config.save_pretrained(tmp_path / "out")
    loaded = type(model).from_pretrained(tmp_path / "out", experts_implementation="eager")
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, trained[key], rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-5)


def record_routing(worker) -> None:
    for m in worker.stages.modules.values():
        if hooks_of(m) is not None:
            hooks_of(m).record_routing = True


def actor_routing(worker) -> tuple:
    return worker.place.replica, {s: hooks_of(m).routing() for s, m in worker.stages.modules.items()
                                  if hooks_of(m) is not None}


@pytest.mark.parametrize("family, aux, rate", [("qwen3_moe", 0.0, 0.0), ("qwen3_moe", 0.01, 0.0),
                                               ("deepseek_v3", 0.0, 0.01)])
def test_a_split_moe_model_trains_at_pp2_dp2_ep2_as_the_model_does(ray_session, family, aux, rate):
    """pp=2 x dp=2 x ep=2 (4 actors, each holding half of a layer's experts): every token goes to
    the experts the one-process model sends it to, and losses and parameters are the model's,
    with the runtime's auxiliary loss (Qwen3-MoE's alternative to output_router_logits) and with
    DeepSeek's bias update (its ``e_score_correction_bias`` compared too)."""
    model, dp, n = tiny(family), 2, MICROBATCHES * 2

    def forward(model, ids, side):
        with loss_scale(1.0 / n):  # the microbatch's loss factor, as the runtime's (actors/experts.py)
            return hf_forward(model, ids, side)

    data = batches(2 * MICROBATCHES * dp)
    ref = Reference(None, n, causal_lm_loss, sgd, model=model, forward=forward)
    attach(ref.model, aux_loss_coef=aux, bias_update_rate=rate, record_routing=True)
    ref_losses = []
    for batch in data:
        ref_losses.append(ref.step(*batch).loss)
        finish_step(ref.model)
    with mpmd.Pipeline(mpmd.split(model, num_stages=2, verbose=False), schedule="1f1b", num_microbatches=MICROBATCHES,
                       loss_fn=causal_lm_loss, optimizer=sgd, dp=dp, ep=2, device="cpu", num_cpus=0.25,
                       moe_aux_loss_coef=aux, moe_bias_update_rate=rate) as pipe:
        pipe.engine.client.run_in_each(record_routing, "recording the routing")
        losses = pipe.fit(data, progress=False)
        state = pipe.state_dict()
        routed = pipe.engine.client.run_in_each(actor_routing, "reading the routing")
    want_routing, checked = hooks_of(ref.model).routing(), 0
    for replica, stages in routed:  # replica d's j-th forward of step t: the model's microbatch t*m*dp + d*m + j
        for blocks in stages.values():
            for name, forwards in blocks.items():
                assert len(forwards) == STEPS * MICROBATCHES
                for t in range(STEPS):
                    for j in range(MICROBATCHES):
                        want = want_routing[name][t * MICROBATCHES * dp + replica * MICROBATCHES + j]
                        assert torch.equal(forwards[t * MICROBATCHES + j], want), (name, replica, t, j)
                        checked += 1
    assert checked == dp * 3 * STEPS * MICROBATCHES  # each replica: the 3 MoE layers over its 2 stages
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    want = ref.model.state_dict()
    assert sorted(state) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
    biases = [k for k in state if k.endswith("e_score_correction_bias")]
    assert bool(rate) == any(not torch.equal(state[k], model.state_dict()[k]) for k in biases), "the bias moved"


def expert_rows(worker) -> dict:
    return {s: {k: tuple(v.shape) for k, v in m.state_dict().items() if k.endswith("experts.gate_up_proj")}
            for s, m in worker.stages.modules.items()}


def test_a_meta_model_splits_into_factories_and_loads_save_pretrained_at_ep2(ray_session, tmp_path):
    """A model given on the meta device splits into stage factories (Note [meta-built stages]):
    each actor builds only its stage, holding 2 of each layer's 4 experts at ep=2, and takes its
    weights from a ``save_pretrained`` directory (one tensor per expert); logits and weights equal
    the saved model's."""
    saved = tiny("qwen3_moe", seed=3).eval()
    saved.save_pretrained(tmp_path)
    with torch.device("meta"):
        meta = transformers.Qwen3MoeForCausalLM(saved.config)
    stages = mpmd.split(meta, num_stages=2, verbose=False)
    assert all(isinstance(s, MetaStageFactory) for s in stages) and stages.layer_counts == [2, 2]
    ids = torch.randint(0, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(0))
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=causal_lm_loss, optimizer=sgd, dp=2,
                       ep=2, device="cpu", num_cpus=0.25) as pipe:
        pipe.load_safetensors(tmp_path)
        logits, state = pipe.predict(ids), pipe.state_dict()
        held = pipe.engine.client.run_in_each(expert_rows, "reading the experts' shapes")
    assert all(shape == (2, 32, 32) for part in held for stage in part.values() for shape in stage.values())
    assert sum(len(stage) for part in held for stage in part.values()) == 2 * 3  # 2 replicas x 3 MoE layers
    want = saved.state_dict()
    assert set(state) == set(want)
    for key, value in want.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(logits, saved(ids).logits, rtol=1e-5, atol=1e-5)


# -- refused, with the reason, before any actor starts ------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_output_router_logits_is_refused_with_the_alternative(family):
    with pytest.raises(ValueError, match=r"output_router_logits=True: .* couples all layers across pipeline "
                                         r"stages .* moe_aux_loss_coef=model.config.router_aux_loss_coef"):
        mpmd.split(tiny(family, output_router_logits=True), num_stages=2, verbose=False)


def test_deepseek_layers_past_num_hidden_layers_are_refused_as_mtp():
    model = tiny("deepseek_v3")
    model.model.layers.append(copy.deepcopy(model.model.layers[-1]))  # as an MTP layer would sit
    with pytest.raises(ValueError, match=r"5 decoder layers but its config says num_hidden_layers=4.*"
                                         r"multi-token-prediction layers"):
        mpmd.split(model, num_stages=2, verbose=False)


def test_a_tied_meta_model_is_refused():
    with torch.device("meta"):
        meta = transformers.MixtralForCausalLM(tiny("mixtral").config)
    with pytest.raises(ValueError, match=r"tied head .* build the model with tie_word_embeddings=False"):
        mpmd.split(meta, num_stages=2, verbose=False)


def test_per_expert_files_name_their_layout_and_a_missing_expert():
    held = {f"model.layers.1.mlp.experts.{e}.{p}.weight": "f" for e in range(3) for p in ("gate_proj", "up_proj")}
    key = "model.layers.1.mlp.experts.gate_up_proj"
    assert hub_source(key, held) == tuple(tuple(f"model.layers.1.mlp.experts.{e}.{p}.weight" for e in range(3))
                                          for p in ("gate_proj", "up_proj"))
    mixtral = {"model.layers.0.block_sparse_moe.gate.weight": "f",
               "model.layers.0.block_sparse_moe.experts.0.w2.weight": "f"}
    assert hub_source("model.layers.0.mlp.gate.weight", mixtral) == "model.layers.0.block_sparse_moe.gate.weight"
    assert hub_source("model.layers.0.mlp.experts.down_proj", mixtral) == (
        ("model.layers.0.block_sparse_moe.experts.0.w2.weight",),)
    del held["model.layers.1.mlp.experts.2.up_proj.weight"]
    with pytest.raises(ValueError, match=r"one tensor per expert but lack \['model.layers.1.mlp.experts.2.up_proj"):
        hub_source(key, held)
    assert hub_source("model.layers.1.self_attn.q_proj.weight", held) is None


def test_a_dense_meta_model_builds_tp_shards_and_float8_files_are_refused(ray_session, tmp_path):
    """Dense models alike: a Llama on the meta device at tp=2 (each actor building only its TP
    shards: ``build_sharded``) loads a ``save_pretrained`` directory with equal logits; files
    holding float8 tensors are refused before any actor reads, naming the tensor."""
    from safetensors.torch import load_file, save_file

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                                   tie_word_embeddings=False)
    torch.manual_seed(4)
    saved = transformers.LlamaForCausalLM(cfg).eval()
    saved.save_pretrained(tmp_path / "hub")
    state = load_file(str(tmp_path / "hub" / "model.safetensors"))
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.float8_e4m3fn)
    (tmp_path / "fp8").mkdir()
    save_file(state, str(tmp_path / "fp8" / "model.safetensors"), metadata={"format": "pt"})
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(cfg)
    stages = mpmd.split(meta, num_stages=2, verbose=False)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=causal_lm_loss, optimizer=sgd, tp=2,
                       tp_plan="auto", device="cpu", num_cpus=0.25) as pipe:
        with pytest.raises(ValueError, match=r"float8 tensors \('model.layers.0.mlp.up_proj.weight' \(F8_E4M3\)\).*"
                                             r"dequantize"):
            pipe.load_safetensors(tmp_path / "fp8")
        pipe.load_safetensors(tmp_path / "hub")
        logits, got = pipe.predict(ids), pipe.state_dict()
    for key, value in saved.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    with torch.no_grad():
        torch.testing.assert_close(logits, saved(ids).logits, rtol=1e-5, atol=1e-5)
