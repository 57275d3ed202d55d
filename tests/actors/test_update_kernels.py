"""The agreed update's fused kernels (actors/update.py) give, on the CPU, exactly what the loops
over parameters they replaced gave: bit for bit, so training is unchanged."""

from __future__ import annotations

import math

import pytest
import torch

from actors.update import scale_, unscale_


def _grads():
    torch.manual_seed(0)
    return [torch.randn(7) * 1e3, torch.randn(3, 4), torch.randn(2, 2, dtype=torch.bfloat16), torch.randn(1) * 1e-30]


def test_unscale_divides_exactly_and_flags_a_non_finite_gradient():
    for scale in (2.0**16, 2.0**-3, 1.0):
        fused, loop = _grads(), _grads()
        assert unscale_(fused, scale).item() == 0.0
        for g in loop:
            g.mul_(1.0 / scale)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(fused, loop))
    for bad in (float("inf"), float("nan")):
        grads = _grads()
        grads[2][0, 1] = bad  # a bf16 one: every dtype's group is checked
        assert unscale_(grads, 2.0**16).item() == 1.0


@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_fused_norms_and_scaling_equal_the_loops(p):
    grads = _grads()
    fused = torch.stack([n.to(torch.float64) for n in torch._foreach_norm(grads, p)])
    loop = torch.stack([torch.linalg.vector_norm(g, p).to(torch.float64) for g in grads])
    assert torch.equal(fused, loop)
    a, b = _grads(), _grads()
    scale_(a, 0.37)
    for g in b:
        g.mul_(0.37)
    assert all(torch.equal(x, y) for x, y in zip(a, b))  # the bfloat16 one too
