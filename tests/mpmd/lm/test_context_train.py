"""``mpmd train``'s context parallelism and document masking without actors: the config's
refusals before anything starts, the shifted targets and the documents' positions."""

from __future__ import annotations

import pytest
import torch

from mpmd.lm import ConfigError, check_pipeline, load_config
from mpmd.lm.recipe import pipeline_options
from mpmd.lm.tokens import document_positions, lm_targets
from mpmd.planning import causal_lm_loss
from mpmd.planning.hf import next_token_loss


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=3"], r"data.seq_len \(64\) must be divisible by 2 x parallel.cp = 6: .* use data.seq_len = 66 "
                        r"or 60"),
    (["parallel.cp=2", "model.family=deepseek_v3"], r"parallel.cp = 2 with model.family = \"deepseek_v3\": its "
                                                    r"multi-head latent attention"),
    (["data.document_mask=true", "parallel.schedule=auto"], r"data.document_mask with parallel.schedule = "
                                                            r"\"auto\": the planner measures"),
    (["parallel.cp=1024", "parallel.stages=4", "parallel.dp=8", "parallel.tp=4"],
     r"parallel.stages x dp x tp x cp = 4 x 8 x 4 x 1024 = 131,072 actors is more than the maximum 65,536"),
])
def test_bad_context_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", overrides)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=2", "parallel.schedule=terapipe", "parallel.stages=2"], r"parallel: cp=2 with TeraPipe's token "
                                                                          r"slices is not supported"),
    (["data.document_mask=true", "parallel.schedule=terapipe"], r"parallel: document_mask=True with TeraPipe"),
    (["parallel.cp=2", "parallel.schedule=auto"], r"parallel: cp=2 with schedule='auto'"),
])
def test_what_the_runtime_refuses_is_refused_before_the_data(overrides, message):
    """The runtime's own checks (mpmd/runtime/config.py, mpmd/runtime/cp.py), run on the config."""
    with pytest.raises(ValueError, match=message):
        check_pipeline(load_config("configs/debug.toml", overrides))


def test_the_pipeline_gets_cp_and_document_mask_only_where_set():
    cfg = load_config("configs/debug.toml", ["parallel.cp=2", "data.document_mask=true"])
    check_pipeline(cfg)
    for both in (["parallel.tp=2"], ["parallel.dp=2", "parallel.zero=1"]):  # cp with tp, with ZeRO-1: built
        check_pipeline(load_config("configs/debug.toml", ["parallel.cp=2"] + both))
    options = pipeline_options(cfg.parallel, cfg.optim, cfg.data.document_mask)
    assert options["cp"] == 2 and options["document_mask"] is True
    plain = load_config("configs/debug.toml")
    assert not {"cp", "document_mask"} & set(pipeline_options(plain.parallel, plain.optim))


def test_shifted_targets_give_causal_lm_loss():
    """Note [shifted targets]: the targets shifted on the whole row, the loss without the shift,
    equal ``causal_lm_loss`` on the rows, bit for bit."""
    torch.manual_seed(0)
    ids = torch.randint(0, 11, (3, 8))
    logits = torch.randn(3, 8, 11)
    targets = lm_targets(ids, True)
    assert targets[:, :-1].equal(ids[:, 1:]) and (targets[:, -1] == -100).all()
    assert lm_targets(ids, False) is ids
    assert next_token_loss(logits, targets).item() == causal_lm_loss(logits, ids).item()


def test_document_positions_restart_after_each_eos():
    eos = 9
    ids = torch.tensor([[4, 5, 9, 1, 2, 3, 9, 9, 7, 8],
                        [9, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
    assert document_positions(ids, eos).tolist() == [[0, 1, 2, 0, 1, 2, 3, 0, 0, 1],
                                                     [0, 0, 1, 2, 3, 4, 5, 6, 7, 8]]


def test_causal_attention_flops_are_half_the_square_by_hand():
    """Note [MFU]: the debug Llama (L=4, query-key and value widths 64 each, 6N = 1,302,528 as
    tests/mpmd/lm/test_flops_dry_run.py counts it) at T=64."""
    from mpmd.lm.flops import document_keys_per_token, flops_per_token
    from mpmd.lm.models import llama_spec

    spec = llama_spec(load_config("configs/debug.toml").model, vocab_size=512)
    six_n = 1_302_528
    # full square: 6 x L x (64 + 64) x T keys per token = 196,608
    assert flops_per_token(spec, 64) == six_n + 6 * 4 * 128 * 64 == 1_499_136
    # causal: T(T+1)/2 = 2,080 pairs per sequence of 64 tokens, 32.5 keys per token: 99,840
    assert flops_per_token(spec, 64, causal=True) == six_n + 6 * 4 * 128 * 32.5 == 1_402_368
    # packed documents of 3, 4 and 1 tokens: 6 + 10 + 1 = 17 pairs over 8 tokens
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0]])
    assert document_keys_per_token(positions) == 17 / 8
    assert flops_per_token(spec, 8, keys_per_token=17 / 8) == six_n + 6 * 4 * 128 * 17 / 8
    # one document filling the row is the causal count
    assert document_keys_per_token(torch.arange(64)[None]) == 32.5


def test_the_dry_run_counts_one_shard_of_activations_per_actor_at_long_sequences():
    """Note [memory at cp]: a Llama-3-8B at 131,072 tokens on 8 ranks x dp 2.  Per actor the
    dry run's peak is P + A / cp: the parameters, gradients and AdamW state (P, 16 bytes per
    parameter: bf16 autocast keeps float32 masters) whole, the activations (A) one shard's; the
    actors are stages x dp x cp, and the step's FLOPs per actor 1/cp."""
    from mpmd.lm.dry_run import dry_run

    base = ["data.seq_len=131072", "model.max_position_embeddings=131072", "parallel.schedule=1f1b",
            "parallel.stages=8", "parallel.actors=8", "parallel.layers=equal", "parallel.microbatches=8",
            "optim.batch_size=16", "parallel.memory_limit_gb=80"]
    plans = {cp: dry_run(load_config("configs/llama3_8b.toml", base + [f"parallel.cp={cp}"])) for cp in (1, 2, 4)}
    one, two, four = plans[1].memory, plans[2].memory, plans[4].memory
    for rank, params in enumerate(plans[1].params):
        whole = 2 * two[rank] - one[rank]  # P from P + A and P + A / 2
        assert whole == pytest.approx(16.0 * params, rel=1e-12)
        assert four[rank] == pytest.approx(whole + (one[rank] - whole) / 4, rel=1e-12)
        assert one[rank] > two[rank] > four[rank]
    assert [plans[cp].actors for cp in (1, 2, 4)] == [16, 32, 64]
    assert plans[2].step_time_s == pytest.approx(plans[1].step_time_s / 2, rel=1e-12)
    assert plans[1].fits is False and plans[4].fits is False  # the last rank's logits: 8 s b V / cp
    assert max(four[:-1]) < 80 * 2 ** 30 < min(one[:-1])
    assert "cp 4 (each actor holds 32,768 of each sequence's 131,072 tokens)" in plans[4].text()
