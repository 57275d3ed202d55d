"""Parameters shared between stages (tied embeddings, a module passed as two stages) train
as one parameter: the same losses and parameters as single-process training (SGD), the
copies on every actor stay bit-identical, and checkpoints and state dicts keep them so.
Note [tie reduction] in schedules/passes.py says how."""

from __future__ import annotations

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import reference_train, sgd

VOCAB, D, MICROBATCHES = 16, 8, 4


class Embed(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, ids):
        return self.embedding(ids)


class TiedHead(nn.Module):
    """Logits through the embedding's own weight (tied input and output embeddings)."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.weight = embedding.weight

    def forward(self, x):
        return x @ self.weight.t()


def tied_lm(num_stages: int) -> list[nn.Module]:
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, D)
    middle = [nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(num_stages - 2)]
    return [Embed(embedding), *middle, TiedHead(embedding)]


def token_data(steps: int, batch: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (batch, 5), generator=g), torch.randint(0, VOCAB, (batch, 5), generator=g))
            for _ in range(steps)]


def lm_loss(logits, targets):
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def assert_equal_to_reference(losses, state, model, ref_losses) -> None:
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-7)
    ref = model.state_dict()
    assert list(state) == list(ref)
    for key, value in ref.items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-7, msg=lambda m: f"{key}: {m}")


def tied_copies(pipe: mpmd.Pipeline, first: int, last: int) -> list[torch.Tensor]:
    """Every actor's copy of the tied weight, read from the actors themselves."""
    copies = []
    for state in ray.get([a.state_dict.remote() for a in pipe.actors]):
        copies += [state[first]["embedding.weight"]] if first in state else []
        copies += [state[last]["weight"]] if last in state else []
    return copies


@pytest.mark.parametrize("schedule, num_stages, dp", [
    ("1f1b", 3, 1),               # the tie spans the first and the last of three actors
    ("interleaved-1f1b", 4, 1),   # stages 0 and 3 on two actors, each with another stage
    ("zbv", 4, 1),                # stages 0 and 3 on one actor (V shape), split backward
    ("1f1b", 2, 2),               # two replicas: the tie sums within each, dp averages across
])
def test_tied_embeddings_across_stages_train_as_one_parameter(ray_session, schedule, num_stages, dp):
    stages, data = tied_lm(num_stages), token_data(3, 4 * dp)
    model, ref_losses = reference_train(stages, data, MICROBATCHES * dp, lm_loss, sgd)
    with mpmd.Pipeline(stages, schedule=schedule, num_microbatches=MICROBATCHES, loss_fn=lm_loss, optimizer=sgd,
                       dp=dp, device="cpu") as pipe:
        reduces = [repr(i) for program in pipe.engine.program("train") for i in program if i.kind.value == "TIE_REDUCE"]
        assert reduces and all(r.endswith("TIE_REDUCE0") for r in reduces)
        losses = []
        for x, y in data:
            losses.append(pipe.step(x, y))
            copies = tied_copies(pipe, 0, num_stages - 1)
            assert len(copies) == 2 * dp and all(torch.equal(c, copies[0]) for c in copies), "the copies drifted"
        state = pipe.state_dict()
    assert_equal_to_reference(losses, state, model, ref_losses)
    assert torch.equal(state["0.embedding.weight"], state[f"{num_stages - 1}.weight"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def test_a_module_passed_as_two_stages_is_one_shared_module(ray_session):
    torch.manual_seed(2)
    shared = Block()
    stages = [nn.Linear(4, 6), shared, shared, nn.Linear(6, 3)]
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 3, generator=g)) for _ in range(3)]
    model, ref_losses = reference_train(stages, data, MICROBATCHES, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu") as pipe:
        assert [t.stages for t in pipe.engine.ties] == [(1, 2)]
        losses = [pipe.step(x, y) for x, y in data]
        state = pipe.state_dict()
    assert_equal_to_reference(losses, state, model, ref_losses)


def test_a_tied_checkpoint_resumes_on_another_layout(ray_session, tmp_path):
    stages, data = tied_lm(4), token_data(4, 4)
    model, ref_losses = reference_train(stages, data, MICROBATCHES, lm_loss, sgd)
    options = dict(loss_fn=lm_loss, optimizer=sgd, device="cpu")
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, **options) as pipe:
        losses = pipe.fit(data[:2], progress=False)
        path = pipe.save(tmp_path / "ck")
    with pytest.warns(UserWarning, match="random number generators start fresh"):
        resumed = mpmd.Pipeline.load(path, stages=tied_lm(4), schedule="zbv", **options)  # 2 actors, stage 0 and 3 together
    with resumed:
        losses += resumed.fit(data[2:], progress=False)
        state = resumed.state_dict()
    assert_equal_to_reference(losses, state, model, ref_losses)


def test_load_state_dict_keeps_tied_values_equal(ray_session):
    with mpmd.Pipeline(tied_lm(2), num_microbatches=2, loss_fn=lm_loss, optimizer=sgd, device="cpu") as pipe:
        state = pipe.state_dict()
        changed = {k: v + 1.0 for k, v in state.items()}
        pipe.load_state_dict(changed)
        assert all(torch.equal(v, changed[k]) for k, v in pipe.state_dict().items())
        with pytest.raises(ValueError, match=r"0.embedding.weight, 1.weight name one tied parameter, but the "
                                             r"state_dict gives them different values"):
            pipe.load_state_dict({**changed, "1.weight": state["1.weight"]})
