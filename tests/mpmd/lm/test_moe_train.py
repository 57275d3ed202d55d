"""mpmd train with experts (docs/moe.md, "mpmd train with experts"): the Qwen3-MoE and
DeepSeek-V3 debug configs train equal to one process (pp=2, and pp=2 x dp=2 x ep=2 with the
bias update), their expert loads, auxiliary loss and router bias reach metrics.csv and
expert_load.csv; the configs' bad MoE input is refused at load."""

from __future__ import annotations

import csv
import os
import re

import pytest
import torch

import mpmd
from mpmd.lm import load_config, run_training
from mpmd.lm.config_io import ConfigError
from mpmd.lm.flops import flops_per_token
from mpmd.lm.job import prepare
from mpmd.lm.models import llama_spec, stage_factories
from mpmd.lm.plan import stage_layer_counts
from mpmd.lm.recipe import AdamWFactory, LRSchedule
from mpmd.moe import attach, finish_step, loss_scale
from mpmd.planning import causal_lm_loss

from tests.models import Reference

# optim.eps: AdamW divides by sqrt(v) + eps, so an element whose gradient is near zero moves by
# about lr whatever its sign's last bit; dp=2 sums the replicas' gradients in another order than
# one process, and at eps=1e-8 one of 11,264 weights moved 4e-5 apart.  eps=1e-4 keeps such an
# element still, and every other one trains as before.
TINY = ["optim.eps=1e-4", "optim.steps=4", "optim.batch_size=8", "optim.warmup_steps=1", "optim.lr=1e-2", "parallel.microbatches=2",
        "data.seq_len=32", "tokenizer.vocab_size=300", "run.eval_every=4", "run.checkpoint_every=0",
        "run.log_every=1", "run.progress=false", "run.eval_batches=1", "run.export=false"]


def _config(config, run_dir, *extra):
    prepared = os.path.join(os.path.dirname(run_dir), "prepared")
    return load_config(config, TINY + [f"run.dir={str(run_dir)!r}", f"data.prepared_dir={prepared!r}", *extra])


def _reference(cfg):
    """The same training in one process: the stages built as the actors build them, gradient
    accumulation over every replica's microbatches, each forward under the microbatch's loss
    scale (the auxiliary loss trained as the actors train it), clipping in float64, AdamW, the
    LR, and the bias update after each step (``finish_step``): losses, state, last metrics."""
    data, tok = prepare(cfg, log=lambda *a: None)
    spec = llama_spec(cfg.model, tok.get_vocab_size())
    counts = stage_layer_counts(cfg, spec)
    stages = mpmd.build_stages(stage_factories(spec, 2, cfg.data.seq_len, counts=counts), seed=cfg.optim.seed)
    n = cfg.parallel.microbatches * cfg.parallel.dp

    def forward(model, x, side):
        with loss_scale(1.0 / n):
            return model(x)

    ref = Reference(stages, n, causal_lm_loss, AdamWFactory(cfg.optim), clip=cfg.optim.clip_grad_norm,
                    norm_in_float64=True, forward=forward,
                    lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, LRSchedule.of(cfg.optim)),
                    step_loss=lambda losses, parts: sum((loss / parts).item() for loss in losses))
    attach(ref.model, aux_loss_coef=cfg.optim.moe_aux_loss_coef, bias_update_rate=cfg.optim.moe_bias_update_rate)
    losses, metrics = [], {}
    for step in range(cfg.optim.steps):
        losses.append(ref.step(*data.batch(step)).loss)
        metrics = finish_step(ref.model)
    return losses, {k: v for stage in ref.model for k, v in stage.state_dict().items()}, metrics  # the model's keys


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def _check_run(cfg, run, keys):
    losses, state, metrics = _reference(cfg)
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    assert all(k in run.state_dict for k in state) and any(".experts." in k for k in state)
    for k, v in state.items():  # the experts (gathered whole from the EP ranks) and the router bias included
        torch.testing.assert_close(run.state_dict[k], v, rtol=1e-4, atol=1e-5, msg=lambda m: f"{k}: {m}")
    rows = _rows(os.path.join(run.run_dir, "metrics.csv"))
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]
    assert all(key in rows[0] and rows[-1][key] for key in keys), rows[0].keys()
    # expert_load.csv: the last step's tokens per expert are the reference's (summed over replicas)
    loads = _rows(os.path.join(run.run_dir, "expert_load.csv"))[-1]
    tokens = cfg.optim.batch_size * cfg.data.seq_len * cfg.model.resolved("experts_per_token")
    for name, value in metrics.items():
        if name.endswith(".load"):
            layer = re.search(r"layers\.(\d+)\.", name).group(1)
            got = [int(loads[f"layer{layer}.expert{e}"]) for e in range(len(value))]
            assert got == [int(x) for x in value] and sum(got) == tokens, (name, got, value)
    ratio = max(max(v) / (sum(v) / len(v)) for k, v in metrics.items() if k.endswith(".load"))
    assert float(rows[-1]["moe_load_max_mean"]) == pytest.approx(ratio)
    return rows


@pytest.mark.parametrize("family", ["qwen3_moe"])
def test_qwen3_moe_debug_trains_as_one_process_with_the_aux_loss(ray_session, tmp_path, family):
    cfg = _config("configs/qwen3_moe_debug.toml", tmp_path / "q")
    assert cfg.model.family == family and cfg.optim.moe_aux_loss_coef > 0
    run = run_training(cfg, keep_state=True, log=lambda *a: None)
    assert all(torch.isfinite(torch.tensor(run.losses))) and run.val[-1][1] < run.losses[0]
    rows = _check_run(cfg, run, ["moe_load_max_mean", "moe_aux_loss", "moe.layer0.aux", "moe.layer3.load_max_mean"])
    assert float(rows[-1]["moe_aux_loss"]) > 0


def test_deepseek_v3_debug_at_ep2_trains_as_one_process_with_the_bias_update(ray_session, tmp_path):
    """pp=2 x dp=2 x ep=2 (4 CPU actors): the experts split over each stage's two replicas, the
    router bias moved once per step from the loads of both; equal to one process."""
    cfg = _config("configs/deepseek_v3_debug.toml", tmp_path / "d", "parallel.dp=2", "parallel.ep=2")
    said = []
    run = run_training(cfg, keep_state=True, log=said.append)
    assert any("8 experts top-2 over ep 2" in line for line in said), said
    rows = _check_run(cfg, run, ["moe_load_max_mean", "moe.layer1.bias_range", "moe.layer3.load_max_mean"])
    assert "moe.layer0.load_max_mean" not in rows[0]  # the first layer is dense
    assert float(rows[-1]["moe.layer1.bias_range"]) > 0  # the bias update moved it
    biases = [v for k, v in run.state_dict.items() if k.endswith("e_score_correction_bias")]
    assert len(biases) == 3 and all(b.abs().max() > 0 for b in biases)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.dp=2", "parallel.ep=2"], r"parallel.ep is for a mixture of experts, but model.family = 'llama'"),
    (["model.family=qwen3_moe", "parallel.dp=3", "parallel.ep=3", "optim.batch_size=24"],
     r"parallel.ep \(3\) must divide model.num_experts"),
    (["model.family=qwen3_moe", "parallel.dp=2", "parallel.ep=4"], r"parallel.ep \(4\) must divide parallel.dp \(2\)"),
    (["model.family=qwen3_moe", "model.experts_per_token=9"], r"experts_per_token \(9\) is more than model.num_"),
    (["model.family=qwen3_moe", "parallel.tp=2"], r"tensor parallelism of a mixture of experts is not built"),
    (["model.family=qwen3_moe", "optim.moe_bias_update_rate=0.001"], r"only DeepSeek-V3's sigmoid router has"),
    (["model.family=deepseek_v3", "optim.moe_bias_update_rate=0.001", "parallel.recompute=true"],
     r"would count its tokens twice"),
    (["model.num_experts=8"], r"model.num_experts is not a key of model.family = 'llama'"),
    (["model.family=qwen3_moe", "model.kv_lora_rank=8"], r"model.kv_lora_rank is not a key of model.family = 'qwen3"),
    (["model.family=deepseek_v3", "model.expert_groups=3"], r"model.expert_groups \(3\) must divide"),
    (["model.family=qwen3_moe", "model.size=671b"], r"model.size = '671b' is not one of 'debug', '235b-a22b'"),
    (["model.family=qwen3_moe", "model.dense_layers=4"], r"leaves none of the 4 layers"),
])
def test_bad_moe_configs_are_refused_at_load(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", overrides)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_mfu_counts_the_active_parameters_of_the_built_model(family):
    """FLOPs per token (Note [MFU]) = 6 x the matrices a token uses + the attention term, the
    matrices counted here on transformers' model built on meta: every parameter but the input
    embedding and the norms, of the routed experts only top-k / E."""
    from mpmd.lm.flops import attention_widths
    from mpmd.lm.models import meta_stages

    cfg = load_config(f"configs/{family}_debug.toml", [])
    spec = llama_spec(cfg.model, 512)
    stages = meta_stages(stage_factories(spec, 2, cfg.data.seq_len))
    k, experts = spec.moe.top_k, spec.moe.num_experts
    active = 0.0
    for stage in stages:
        for name, p in stage.named_parameters():
            if "embed_tokens" in name or "norm" in name:
                continue
            active += p.numel() * (k / experts if ".experts." in name else 1)
    assert active < sum(p.numel() for s in stages for p in s.parameters())
    attention = 6.0 * spec.num_layers * sum(attention_widths(spec)) * cfg.data.seq_len
    assert flops_per_token(spec, cfg.data.seq_len) == pytest.approx(6.0 * active + attention, rel=1e-12)


def test_the_deepseek_v3_671b_dry_run_fits_80_gb_at_pp16_x_ep64():
    """configs/deepseek_v3_671b.toml: 16 stages x dp 64 with 64-way EP (1,024 GPUs) fits 80 GB
    an actor; its experts are what needs the EP: at ep=1 it does not fit."""
    from mpmd.lm.dry_run import dry_run

    plan = dry_run(load_config("configs/deepseek_v3_671b.toml", []))
    gib = 2 ** 30
    assert plan.actors == 1024 and plan.fits and max(plan.memory) < 80 * gib
    assert sum(plan.params) == 671_026_404_352  # transformers' DeepseekV3ForCausalLM, no MTP layer
    assert plan.experts[0] == 0 and plan.experts[1] == 4 * 256 * 3 * 7168 * 2048  # 3 dense layers, then 4 MoE
    assert plan.per_actor[1] == plan.params[1] - plan.experts[1] * 63 // 64
    assert 20 * gib < max(plan.memory) < 40 * gib, [m / gib for m in plan.memory]
    text = plan.text()
    assert "actors: 1024 (GPUs: 16 pipeline ranks x dp 64, the experts over EP groups of 64 replicas); fits " \
           "memory_limit_gb = 80" in text
    assert "split over ep=64: an actor holds 4 per layer" in text
    # 37B active parameters (DeepSeek-V3's count) + the attention at 4,096 positions
    assert 6 * 46.8e9 < flops_per_token(plan.spec, 4096) < 6 * 46.9e9
    whole = dry_run(load_config("configs/deepseek_v3_671b.toml", ["parallel.ep=1"]))
    assert not whole.fits and min(whole.memory[1:14]) > 600 * gib  # 45B experts a stage at 16 B each


def test_the_qwen3_235b_dry_run_fits_80_gb_at_pp8_x_ep16():
    from mpmd.lm.dry_run import dry_run

    plan = dry_run(load_config("configs/qwen3_235b_a22b.toml", []))
    assert plan.actors == 128 and plan.fits and max(plan.memory) < 80 * 2 ** 30
    assert sum(plan.params) == 235_093_634_560
