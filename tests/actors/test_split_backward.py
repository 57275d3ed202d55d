"""The zero-bubble split backward (``I`` then ``W``) gives the gradients plain autograd
gives, as does the fused backward, and takes the weight-seed path (Note [weight seeds])
wherever that is exact.  The reference is ``torch.autograd.backward`` on the module
itself, not the project's stage code."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from actors.split_backward import plan_weight_seeds
from actors.stage_exec import Slot, backward_full, backward_input, backward_weight, detach_for_next, forward
from mpmd.models import GPTConfig, gpt_stages, lm_loss


class Tied(nn.Module):  # one Linear applied twice: its weight under two weight nodes
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return (x + self.down(torch.relu(self.up(self.ln(x))))) * self.scale


class Detached(nn.Module):  # one output does not depend on the input at all
    def __init__(self):
        super().__init__()
        self.lin, self.bias = nn.Linear(8, 8), nn.Parameter(torch.ones(8))

    def forward(self, x):
        return self.lin(x), self.bias * 2


class Chunked(nn.Module):  # a weight node with two outputs (chunk) and a 3-D linear
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 16)

    def forward(self, x):
        a, b = self.lin(x.view(2, 2, 8)).chunk(2, dim=-1)
        return (a * torch.sigmoid(b)).reshape(4, 8)


class Frozen(nn.Module):  # a parameter that does not train
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.a.weight.requires_grad_(False)

    def forward(self, x):
        return self.b(self.a(x))


def _autograd(module: nn.Module, inputs: list):
    """The reference: plain autograd, the same output gradients as ``_grads`` hands out."""
    grads_in = []
    for i, x in enumerate(inputs):
        x = x.clone().requires_grad_(True)
        out = module(x)
        outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.is_floating_point() and t.requires_grad]
        torch.autograd.backward(outs, [torch.full_like(t, 0.5 + i) for t in outs])
        grads_in.append([x.grad])
    return grads_in, [p.grad for p in module.parameters()]


def _grads(module: nn.Module, inputs: list, split: bool):
    grads_in = []
    for i, x in enumerate(inputs):
        slot = Slot()
        slot.inp, slot.inp_grad = detach_for_next(x, True)
        forward(module, slot, None, None, 1.0)
        slot.grad_out = [torch.full_like(t, 0.5 + i) for t in slot.out_float]
        if split:
            backward_input(module, slot)
            grads_in.append(slot.grad_in)
            backward_weight(module, slot)
            assert slot.out is None and slot.weight_seeds is None  # the graph goes with W
        else:
            backward_full(slot)
            grads_in.append(slot.grad_in)
    return grads_in, [p.grad for p in module.parameters()]


def _seeded(module: nn.Module, x: torch.Tensor) -> bool:
    out = module(x.requires_grad_(True))
    roots = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
    params = {id(p): p for p in module.parameters() if p.requires_grad}
    return plan_weight_seeds(roots, params) is not None


MODULES = {
    "linear": (lambda: nn.Linear(8, 8), True),
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.LayerNorm(8)), True),
    "residual": (Residual, True),
    "detached output": (Detached, True),
    "chunked": (Chunked, True),
    "frozen weight": (Frozen, True),
    "tied": (Tied, False),  # falls back to the backward walked again
}


@pytest.mark.parametrize("split", [True, False], ids=["split I+W", "fused B"])
@pytest.mark.parametrize("name", list(MODULES))
def test_backward_equals_plain_autograd(name, split):
    make, seeded = MODULES[name]
    torch.manual_seed(0)
    module = make()
    reference = copy.deepcopy(module)
    inputs = [torch.randn(4, 8) for _ in range(3)]
    got_in, got_params = _grads(module, inputs, split=split)
    want_in, want_params = _autograd(reference, inputs)
    for a, b in zip(got_in, want_in, strict=True):
        for ga, gb in zip(a, b, strict=True):
            torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-7)
    assert any(g is not None for g in want_params)
    for ga, gb in zip(got_params, want_params, strict=True):
        assert (ga is None) == (gb is None)
        if ga is not None:
            torch.testing.assert_close(ga, gb, rtol=1e-6, atol=1e-7)
    assert _seeded(make(), torch.randn(4, 8)) == seeded


def test_split_backward_on_gpt_stages_equals_plain_autograd():
    """The bench GPT's stages (embedding, attention, LayerNorm, head with the loss)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=11, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    stages = gpt_stages(cfg, 2)
    fused, reference = copy.deepcopy(stages), nn.Sequential(*copy.deepcopy(stages))
    tokens = torch.randint(0, 11, (3, 2, 8))
    targets = torch.randint(0, 11, (3, 2, 8))
    for x, y in zip(tokens, targets, strict=True):
        (lm_loss(reference(x), y) / 3).backward()
    for split, (s0, s1) in ((True, stages), (False, fused)):
        for x, y in zip(tokens, targets, strict=True):
            first, last = Slot(), Slot()
            first.inp, first.inp_grad = x, []
            forward(s0, first, None, None, 1.0)
            last.inp, last.inp_grad = detach_for_next(first.out, True)
            forward(s1, last, y, lm_loss, 1 / 3)
            if split:
                backward_input(s1, last)
                assert last.weight_seeds, "the last stage should take the weight-seed path"
                first.grad_out = last.grad_in
                backward_weight(s1, last)
                backward_input(s0, first)  # integer input: W does the whole backward
                backward_weight(s0, first)
            else:
                backward_full(last)
                first.grad_out = last.grad_in
                backward_full(first)
    want = [p.grad for p in reference.parameters()]
    for got in (stages, fused):
        grads = [p.grad for p in nn.Sequential(*got).parameters()]
        for (name, _), g, w in zip(reference.named_parameters(), grads, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")
