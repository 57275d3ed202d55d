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
    (["parallel.cp=1024", "parallel.stages=4", "parallel.dp=8", "parallel.tp=4"],
     r"parallel.stages x dp x tp x cp = 4 x 8 x 4 x 1024 = 131,072 actors is more than the maximum 65,536"),
])
def test_bad_context_configs_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", overrides)


@pytest.mark.parametrize("overrides, message", [
    (["parallel.cp=2", "parallel.tp=2"], r"parallel: cp=2 with tp=2 is not supported yet"),
    (["parallel.cp=2", "parallel.dp=2", "parallel.zero=1"], r"parallel: cp=2 with zero=1 is not supported yet"),
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
