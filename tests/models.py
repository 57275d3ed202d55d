"""Small models and the single-process reference the runtime is compared against."""

from __future__ import annotations

import copy

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.tanh(self.fc(x)))


class Embed(nn.Module):
    def __init__(self, d_in: int, d: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_in, d)

    def forward(self, x):
        return torch.relu(self.proj(x))


class Head(nn.Module):
    def __init__(self, d: int, d_out: int) -> None:
        super().__init__()
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        return self.out(x)


class SplitPair(nn.Module):
    """Returns a tuple: multi-tensor values between stages."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.a = nn.Linear(d, d)
        self.b = nn.Linear(d, d)

    def forward(self, x):
        return self.a(x), {"gate": torch.sigmoid(self.b(x)), "mask": (x > 0).to(torch.int64)}


class JoinPair(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c = nn.Linear(d, d)

    def forward(self, value):
        h, extra = value
        return self.c(h * extra["gate"]) + extra["mask"].float()


def make_stages(n: int, d_in: int = 6, d: int = 8, d_out: int = 3, seed: int = 0) -> list[nn.Module]:
    """n >= 2 stages of different layer types: an embedding, blocks, a head."""
    torch.manual_seed(seed)
    stages: list[nn.Module] = [Embed(d_in, d)]
    for i in range(n - 2):
        stages.append(Block(d) if i % 2 == 0 else nn.Sequential(nn.Linear(d, d), nn.GELU()))
    stages.append(Head(d, d_out))
    return stages


def make_data(steps: int, batch: int, d_in: int = 6, d_out: int = 3, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, d_in, generator=g), torch.randn(batch, d_out, generator=g)) for _ in range(steps)]


def adamw(params):
    """AdamW: exercises optimizer state; almost blind to a gradient's scale (use ``sgd`` for that)."""
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def sgd(params):
    """SGD with momentum: every update is proportional to the gradient, so a gradient off by
    any factor (a lost 1/num_microbatches, a sum for a mean) changes the parameters; the
    momentum buffers are optimizer state that checkpoints must carry."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def with_gradient_scale(optimizer, factor: float):
    """A fault for the tests that check the others can fail: ``optimizer``'s factory whose
    optimizers multiply every gradient by ``factor`` before stepping (inside the actors)."""
    return _ScaledOptimizerFactory(optimizer, factor)


class _ScaledOptimizerFactory:
    def __init__(self, optimizer, factor: float) -> None:
        self.optimizer, self.factor = optimizer, factor

    def __call__(self, params):
        opt = self.optimizer(params)
        step, factor = opt.step, self.factor

        def scaled_step(*args, **kwargs):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        p.grad.mul_(factor)
            return step(*args, **kwargs)

        opt.step = scaled_step
        return opt


def reference_train(stages, data, num_microbatches: int, loss_fn, optimizer=adamw):
    """Plain single-process gradient accumulation over the same microbatches."""
    model = nn.Sequential(*copy.deepcopy(stages))
    opt = optimizer(model.parameters())
    losses = []
    for inputs, targets in data:
        total = 0.0
        for x, y in zip(inputs.chunk(num_microbatches), targets.chunk(num_microbatches), strict=True):
            loss = loss_fn(model(x), y)
            (loss / num_microbatches).backward()
            total += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total / num_microbatches)
    return model, losses


def assert_trained_like_reference(losses, params, stages, data, num_microbatches: int, loss_fn, optimizer) -> None:
    """``losses`` and ``params`` (the state dict's values, in order) of a pipeline trained on
    ``data`` equal ``reference_train``'s (float32, tight tolerance)."""
    ref, ref_losses = reference_train(stages, data, num_microbatches, loss_fn, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
