"""The state of expert-parallel stages (Note [expert pieces] in actors/expert_state.py): a
checkpoint written at pp=2 x dp=2 x ep=2 resumes at ep=1 (another dp and zero too) and back,
equal to one process trained without interruption; ``state_dict`` holds the whole experts at
any ep and ``load_state_dict`` gives each EP rank its slice; the HF export writes whole fused
expert tensors."""

from __future__ import annotations

import os

import pytest
import torch

from safetensors.torch import load_file

import mpmd
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss
from mpmd.moe import loss_scale
from mpmd.training.checkpoint import checkpoint_arguments
from mpmd.training.export import export_checkpoint
from tests.models import Reference, sgd

MICROBATCHES, ROWS, STEPS = 2, 2, 4  # per replica at dp=2; rows per microbatch
BATCH = MICROBATCHES * 2 * ROWS  # every leg's global batch: dp=2 x 2 microbatches, or dp=1 x 4


def _stages() -> list:
    config = GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=4, n_experts=4, top_k=2,
                       expert_hidden=6)
    return gpt_stages(config, 2)


def _data() -> list:
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 16, (BATCH, 6), generator=g), torch.randint(0, 16, (BATCH, 6), generator=g))
            for _ in range(STEPS)]


def _reference(stages, data: list) -> tuple[list, dict]:
    n = MICROBATCHES * 2

    def forward(model, x, side):
        with loss_scale(1.0 / n):  # the runtime's microbatch loss scale (actors/experts.py)
            return model(x)

    ref = Reference(stages, n, lm_loss, sgd, forward=forward)
    return [ref.step(x, y).loss for x, y in data], ref.model.state_dict()


def _pipeline(stages, *, dp: int, ep: int, zero: int = 0) -> mpmd.Pipeline:
    return mpmd.Pipeline(stages, num_microbatches=MICROBATCHES * 2 // dp, loss_fn=lm_loss, optimizer=sgd, dp=dp,
                         ep=ep, zero=zero, num_actors=2, device="cpu")


def _assert_state(state: dict, ref: dict) -> None:
    assert state.keys() == ref.keys()
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5, msg=lambda msg: f"{k}: {msg}")


# (dp, ep, zero, steps) per leg: each leg loads the checkpoint the one before wrote.  Between
# them every way in: EP pieces cut at ep=2 and assembled whole at ep=1, whole tensors sliced at
# ep=2, and ZeRO-1's dense shards beside the experts' state, at dp=2 and dp=1.
LEGS = {"ep2-ep1-ep2": [(2, 2, 0, 2), (2, 1, 0, 1), (2, 2, 0, 1)],
        "zero1-ep2-ep2-dp1": [(2, 2, 1, 2), (2, 2, 0, 1), (1, 1, 1, 1)]}


@pytest.mark.parametrize("legs", list(LEGS), ids=list(LEGS))
def test_a_checkpoint_at_ep2_resumes_at_ep1_and_back_equal_to_one_process(ray_session, tmp_path, legs):
    stages, data = _stages(), _data()
    ref_losses, ref_state = _reference(stages, data)
    losses, path, at, states = [], None, 0, []
    for i, (dp, ep, zero, steps) in enumerate(LEGS[legs]):
        with _pipeline(stages, dp=dp, ep=ep, zero=zero) as pipe:
            if path is not None:
                pipe.load(path)
            losses += [pipe.step(x, y) for x, y in data[at:at + steps]]
            at += steps
            saved = pipe.save(tmp_path / f"leg-{i}", blocking=i > 0)  # the first leg's on the writer threads
            path = saved if i else saved.result()
            states.append(pipe.state_dict())
        _check_files(path, dp, ep, zero)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    _assert_state(states[-1], ref_state)
    exported = export_checkpoint(str(tmp_path / "leg-0"), str(tmp_path / "hf"))  # offline, from the EP parts
    tensors = {}
    for file in sorted(set(exported.values())):
        tensors.update(load_file(str(tmp_path / "hf" / file)))
    assert tensors.keys() == states[0].keys()
    for k, v in states[0].items():
        assert torch.equal(tensors[k], v), k
    assert checkpoint_arguments(str(tmp_path / "leg-0"), {})[1]["ep"] == 2  # Pipeline.load restores ep...
    with pytest.warns(UserWarning, match="ep=2, which does not divide dp=1; loading it at ep=1"):
        assert checkpoint_arguments(str(tmp_path / "leg-0"), {"dp": 1})[1]["ep"] == 1  # ...where it fits the dp


def _check_files(path, dp: int, ep: int, zero: int) -> None:
    """EP rank 1's part files at ep=2 (none at ep=1), and the experts' optimizer state beside
    them, never in ZeRO-1's dense shards (at ep=1 the experts are dense parameters there)."""
    files = os.listdir(path)
    assert ("stage-0000.ep-0001.pt" in files and "stage-0001.ep-0001.pt" in files) == (ep == 2)
    head = torch.load(os.path.join(path, "stage-0000.pt"), weights_only=True)
    names = list(head.get("expert_optimizer") or {})
    assert (len(names) == 4) == (ep == 2) and all(n.endswith(("gate_up_proj", "down_proj")) for n in names)
    if zero:
        shards = [torch.load(os.path.join(path, f"optim-0001-{d:04d}.pt"), weights_only=True) for d in range(dp)]
        held = [n for shard in shards for n in shard["state"] if ".experts." in n]
        assert all(shard["state"] for shard in shards) and len(held) == (0 if ep == 2 else 4)


def test_state_dict_is_whole_at_any_ep_and_load_state_dict_and_export_slice_it(ray_session, tmp_path):
    stages, data = _stages(), _data()[:2]
    states = {}
    for ep in (2, 1):
        with _pipeline(stages, dp=2, ep=ep) as pipe:
            for x, y in data:
                pipe.step(x, y)
            states[ep] = pipe.state_dict()
    _assert_state(states[2], states[1])
    experts = [k for k in states[1] if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert experts and all(states[2][k].shape[0] == 4 for k in experts)  # whole: all 4 experts
    g = torch.Generator().manual_seed(7)
    distinct = {k: torch.randn(v.shape, generator=g) if v.is_floating_point() else v for k, v in states[1].items()}
    with _pipeline(stages, dp=2, ep=2) as pipe:
        one_rank = {**distinct, experts[0]: distinct[experts[0]][:2]}  # an EP rank's share is not the tensor
        with pytest.raises(ValueError, match=f"state_dict\\[{experts[0]!r}\\] has shape"):
            pipe.load_state_dict(one_rank)
        pipe.load_state_dict(distinct)
        back = pipe.state_dict()
        weight_map = pipe.export_safetensors(tmp_path / "hf")
    for k, v in distinct.items():
        assert torch.equal(back[k], v), k
    exported = {}
    for file in sorted(set(weight_map.values())):
        exported.update(load_file(str(tmp_path / "hf" / file)))
    assert exported.keys() == distinct.keys()
    for k in experts:
        assert torch.equal(exported[k], distinct[k]), k  # fused [E, ...], gathered from both EP ranks
    assert len(set(weight_map[k] for k in experts)) > 1  # the EP ranks share the writing
