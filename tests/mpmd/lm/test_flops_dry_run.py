"""MFU against a hand count, and the dry run (no actors, meta device)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

import mpmd
from mpmd.lm import flops_per_token, load_config, mfu
from mpmd.lm.dry_run import dry_run
from mpmd.lm.models import llama_spec, param_counts, stage_factories

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_flops_per_token_by_hand_for_the_debug_config():
    cfg = load_config("configs/debug.toml")
    spec = llama_spec(cfg.model, vocab_size=512)
    # debug Llama: hidden h=64, L=4 layers, 4 heads of 16 (2 KV heads: k, v are 64 -> 32), FFN 176, V=512, T=64.
    attention = 64 * 64 + 64 * 32 + 64 * 32 + 64 * 64  # q, k, v, o = 12,288
    mlp = 3 * 64 * 176  # gate, up, down = 33,792
    head = 64 * 512  # the LM head = 32,768 (the input embedding is a lookup: not counted)
    n = 4 * (attention + mlp) + head  # = 217,088
    assert n == 217_088
    expected = 6 * n + 12 * 4 * 64 * 64  # 1,302,528 + 196,608 (attention scores and values, L*h*T)
    assert expected == 1_499_136
    assert flops_per_token(spec, 64) == expected
    # N is the model's parameters without the embedding table and the norms (not matmuls).
    total = sum(param_counts(mpmd.build_stages(stage_factories(spec, 2, 64))))
    assert total == n + 512 * 64 + (2 * 4 + 1) * 64
    # 10,000 tokens/s on 2 devices of 1e11 FLOP/s: 1.499136e10 / 2e11
    assert abs(mfu(10_000, expected, 2, 1e11) - 0.0749568) < 1e-12


def test_dry_run_debug():
    plan = dry_run(load_config("configs/debug.toml", ["parallel.memory_limit_gb=1"]))
    assert plan.params == [125_184, 125_248] and plan.layers == [[0, 1], [2, 3]]
    assert plan.actors == 2 and plan.fits is True
    assert 0 < plan.bubble < 0.5
    text = plan.text()
    assert "schedule 1f1b: 2 ranks x 4 microbatches" in text and "rank 0:" in text and "fits memory_limit_gb" in text
    tight = dry_run(load_config("configs/debug.toml", ["parallel.memory_limit_gb=0.0001"]))
    assert tight.fits is False and "does NOT fit" in tight.text()


def test_dry_run_counts_zero_1_as_the_moments_split_over_dp():
    plain = dry_run(load_config("configs/debug.toml", ["parallel.dp=2"]))
    sharded = dry_run(load_config("configs/debug.toml", ["parallel.dp=2", "parallel.zero=1"]))
    # 16 B/param (weights 4, grads 4, AdamW's moments 8) -> 4 + 4 + 8/2 = 12 B/param; activations unchanged
    for rank, params in enumerate(plain.params):
        assert plain.memory[rank] - sharded.memory[rank] == 4.0 * params


def test_dry_run_auto_picks_a_candidate():
    plan = dry_run(load_config("configs/debug.toml", ["parallel.schedule=auto", "parallel.stages=4"]))
    assert plan.candidates and plan.schedule.name in {c[0] for c in plan.candidates}


def test_dry_run_8b_is_fast_and_small():
    out = subprocess.run([sys.executable, "-m", "mpmd", "train", "configs/llama3_8b.toml", "--dry-run"], cwd=REPO,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert out.returncode == 0, out.stderr
    assert "8,030,261,248 parameters" in out.stdout
    assert "actors: 16 (GPUs); fits memory_limit_gb = 75" in out.stdout
    assert re.search(r"peak memory per actor .*rank 7: [0-9.]+ GiB", out.stdout)
    # Note [balanced layers]: the head's stage gives a layer away, and the step is predicted shorter
    line = re.search(r"layers: balanced for dualpipev: \[([0-9, ]+)\]; predicted step ([0-9.]+) s against "
                     r"([0-9.]+) with equal layers", out.stdout)
    assert line, out.stdout
    counts = [int(x) for x in line[1].split(",")]
    assert len(counts) == 16 and sum(counts) == 32 and counts[-1] == 1 and float(line[2]) < 0.9 * float(line[3])
    seconds, rss_mb = map(float, re.search(r"dry run: ([0-9.]+) s, controller RSS \+([0-9]+) MB", out.stdout).groups())
    # No weights are allocated: the 8B model's 32 GB of float32 would show here (its time, ~3 s, is
    # printed, not asserted: the machine is shared).
    assert rss_mb < 500, (seconds, rss_mb)


def test_peak_flops_sources():
    from mpmd.lm.flops import GPU_PEAK_FLOPS, peak_flops

    assert peak_flops("cuda", "bf16", override=1e15) == (1e15, "run.peak_flops")
    cpu, how = peak_flops("cpu", "fp32")
    assert cpu > 1e8 and "measured" in how
    if not torch.cuda.is_available():
        assert peak_flops("cuda", "bf16") == (None, "the controller sees no GPU to name; set run.peak_flops "
                                                    "(FLOP/s per GPU) for MFU")
    assert GPU_PEAK_FLOPS["H100"]["bf16"] == 989e12


def test_dry_run_counts_tp_as_the_matrices_split_over_a_stages_actors():
    """Each of a stage's 2 actors holds half of every matrix, its layers' activations but the
    gathered inputs of attention and the MLP (30/2 + 4 of 34 units per token: Note [dry-run
    memory]) and half of the logits (loss_parallel)."""
    plain = dry_run(load_config("configs/debug.toml", []))
    split = dry_run(load_config("configs/debug.toml", ["parallel.tp=2"]))
    assert split.actors == 2 * plain.actors
    h, vocab, seq = split.spec.hidden_size, split.spec.vocab_size, split.cfg.data.seq_len
    micro = split.cfg.optim.batch_size // split.cfg.parallel.microbatches
    in_flight = [2, 1]  # 1F1B on 2 ranks, 4 microbatches: rank r's peak holds 2 - r of them
    last = len(plain.params) - 1
    for rank, params in enumerate(plain.params):  # 16 B per parameter: half of every matrix leaves each actor
        norms = h * (2 * len(plain.layers[rank]) + (rank == last))
        activations = in_flight[rank] * len(plain.layers[rank]) * seq * micro * h * (34 - (30 / 2 + 4)) * 4 / 2
        logits = 8.0 * seq * micro * vocab / 2 if rank == last else 0.0
        assert plain.memory[rank] - split.memory[rank] == pytest.approx(16.0 * (params - norms) / 2 + activations
                                                                        + logits)
