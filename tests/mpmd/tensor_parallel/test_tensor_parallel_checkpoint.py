"""Checkpoints across tensor-parallel layouts: each TP rank writes its own pieces of the sharded
tensors and an actor reads only its box of them (Note [checkpoint pieces] in actors/pieces.py),
so a checkpoint saved at tp=2 loads at tp=1 and one saved at tp=1 loads at tp=2 (with dp and
zero=1 changing too), and training continues as one uninterrupted single-process run."""

from __future__ import annotations

import copy
import os
import warnings

import torch

import mpmd
from actors.pieces import PIECES, is_pieces
from mpmd.planning import causal_lm_loss

from tests.models import sgd
from tests.mpmd.tensor_parallel.test_tensor_parallel import CLIP, LogitsOnly, batches, llama_case, reference, warmup

GLOBAL_MICROBATCHES = 4
# (tp, dp, zero): sharded -> whole -> sharded with replicas that split the optimizer state ->
# whole again, reading the pieces of every TP rank and replica.
PHASES = [(2, 1, 0), (1, 1, 0), (2, 2, 1), (1, 2, 1)]
STEPS = 1


def test_a_tp2_checkpoint_loads_at_tp1_and_back_and_continues_like_one_process(ray_session, tmp_path):
    model, stages = llama_case(2, tied=True)
    data = batches(64, 2 * GLOBAL_MICROBATCHES, steps=STEPS * len(PHASES))
    losses, path = [], None
    for i, (tp, dp, zero) in enumerate(PHASES):
        options = dict(schedule="1f1b", tp=tp, tp_plan="auto", dp=dp, zero=zero, num_microbatches=GLOBAL_MICROBATCHES // dp,
                       loss_fn=causal_lm_loss, optimizer=sgd, lr_scheduler=warmup, clip_grad_norm=CLIP,
                       device="cpu", num_cpus=0.25)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # another layout: the actors' RNGs start fresh (no dropout here)
            pipe = (mpmd.Pipeline(copy.deepcopy(stages), **options) if path is None
                    else mpmd.Pipeline.load(path, stages=copy.deepcopy(stages), **options))
        with pipe:
            losses += [pipe.step(x, y) for x, y in data[i * STEPS:(i + 1) * STEPS]]
            path = pipe.save(tmp_path / f"phase-{i}")
            state = pipe.state_dict()
            if tp == 2:  # stage 0's TP group: both gather, only TP rank 0 sends the stage
                parts = pipe.engine.client.state_dicts(indices=[0, 1])
                assert list(parts[0]) == [0] and parts[1] == {}
        saved = torch.load(os.path.join(path, "stage-0000.pt"), weights_only=True)
        emb = saved["module"]["model.embed_tokens.weight"]
        if tp == 1:
            assert tuple(emb.shape) == (64, 32) and "stage-0000.tp-0001.pt" not in os.listdir(path)
        else:  # vocab-parallel: TP rank 0 wrote rows 0-31, TP rank 1 rows 32-63 into its own file
            other = torch.load(os.path.join(path, "stage-0000.tp-0001.pt"), weights_only=True)
            theirs = other["module"]["model.embed_tokens.weight"]
            assert is_pieces(emb) and emb["shape"] == [64, 32] and theirs["shape"] == [64, 32]
            assert [(p["offset"], tuple(p["tensor"].shape)) for p in emb[PIECES] + theirs[PIECES]] == \
                [([0, 0], (32, 32)), ([32, 0], (32, 32))]
            assert other["module"]["model.layers.0.input_layernorm.weight"] is None  # replicated: TP rank 0 writes it
    ref, ref_losses = reference(None, data, GLOBAL_MICROBATCHES, causal_lm_loss, sgd,
                                model=LogitsOnly(copy.deepcopy(model)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    want = ref.lm.state_dict()
    for key, got in state.items():
        torch.testing.assert_close(got, want[key], rtol=1e-4, atol=1e-5)


def test_the_actors_export_safetensors_that_hold_the_pipelines_weights(ray_session, tmp_path):
    """Note [export from the actors]: at pp=2 x tp=2 each of the 4 actors writes a file, the
    TP ranks sharing their stage's tensors; every key is written once (the tied embedding by
    the first stage), whole, equal to ``pipe.state_dict()``; ``dtype`` casts on the actors."""
    import json

    from safetensors.torch import load_file

    from mpmd.training.export import export_checkpoint

    _, stages = llama_case(2, tied=True)
    with mpmd.Pipeline(copy.deepcopy(stages), schedule="1f1b", tp=2, tp_plan="auto", num_microbatches=2,
                       loss_fn=causal_lm_loss, optimizer=sgd, device="cpu", num_cpus=0.25) as pipe:
        weight_map = pipe.export_safetensors(tmp_path / "hf")
        half = pipe.export_safetensors(tmp_path / "bf16", dtype="bfloat16", skip=["lm_head.weight"])
        state = pipe.state_dict()
        checkpoint = pipe.save(tmp_path / "ck")
    # Offline, from the checkpoint's TP pieces: the same tensors, one file of ~40 KB each.
    offline = export_checkpoint(checkpoint, str(tmp_path / "offline"), max_shard_bytes=40_000)
    assert set(offline) == set(state) and len(set(offline.values())) > 1
    for name in sorted(set(offline.values())):
        for key, value in load_file(str(tmp_path / "offline" / name)).items():
            assert torch.equal(value, state[key]), key
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == weight_map and set(weight_map) == set(state)
    files = sorted(set(weight_map.values()))
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]  # every actor wrote some
    written = {}
    for name in files:
        written.update(load_file(str(tmp_path / "hf" / name)))
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in written.values())
    for key, value in state.items():
        torch.testing.assert_close(written[key], value, rtol=0, atol=0)
    assert "lm_head.weight" not in half and set(half) == set(state) - {"lm_head.weight"}
    emb = load_file(str(tmp_path / "bf16" / half["model.embed_tokens.weight"]))["model.embed_tokens.weight"]
    assert emb.dtype == torch.bfloat16 and torch.equal(emb, state["model.embed_tokens.weight"].bfloat16())
