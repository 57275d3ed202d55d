"""Small models and the single-process reference the runtime is compared against."""

from __future__ import annotations

import copy
from typing import NamedTuple

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


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Record(NamedTuple):
    """One reference step: its loss (``step_loss`` of the microbatch losses), the gradient norm
    before clipping (None without a clip) and the learning rate the step used."""

    loss: float
    grad_norm: float | None
    lr: float


def mean_loss(losses, num_microbatches: int) -> float:
    """A step's loss: the mean of its microbatches' losses (what ``Pipeline.step`` returns)."""
    return sum(loss.item() for loss in losses) / num_microbatches


def _whole_model(model, x, side):
    return model(x)


def _on(device, value):
    if device is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.to(device)
    return type(value)(_on(device, v) for v in value)


class Reference:
    """The single-process reference every equivalence test compares against: the model in one
    process, plain gradient accumulation over the same microbatches (each loss divided by their
    number), then the recipe as plain PyTorch does it: clip, optimizer step, LR schedule.

    ``stages`` are run as ``nn.Sequential(*copy.deepcopy(stages))``; ``model`` (a deep copy of
    it) instead when the test holds a whole model. Options, each as a test needs it:
    ``clip``/``norm_type``: clip the gradient norm (recorded before clipping); ``norm_in_float64``:
    take that norm over float64 copies of the gradients, as the actors do (Note [agreed
    update]); ``lr_scheduler``: stepped after each optimizer step; ``precision`` "bf16"/"fp16":
    autocast with each stage's output cast to its dtype (Note [precision boundary]);
    ``grad_scaler``: a ``GradScaler`` at this initial scale scales the backward and steps the
    optimizer (``skipped``: whether it skipped each step); ``device``: the model and each
    microbatch on it (a GPU test's reference on the same GPU); ``forward(model, x, side)``: the
    model's call where it is not ``model(x)``; side values of a step (a batch ``(x, y, side)``)
    are sliced per microbatch except the ``whole_side`` ones, and ``loss_side`` names those the
    loss takes as keywords; ``step_loss(losses, num_microbatches)``: a step's recorded loss from
    its microbatches' loss tensors (``mean_loss`` unless a test sums them its own way)."""

    def __init__(self, stages, num_microbatches: int, loss_fn, optimizer=adamw, *, model=None, clip=None,
                 norm_type=2.0, norm_in_float64=False, lr_scheduler=None, precision="fp32", grad_scaler=None,
                 device=None, forward=None, whole_side=(), loss_side=(), step_loss=mean_loss) -> None:
        model = copy.deepcopy(model) if model is not None else nn.Sequential(*copy.deepcopy(stages))
        self.model = model.to(device) if device is not None else model  # deepcopy and .to keep ties tied
        self.opt = optimizer(self.model.parameters())
        self.scheduler = lr_scheduler(self.opt) if lr_scheduler else None
        self.scaler = torch.amp.GradScaler(device, init_scale=grad_scaler) if grad_scaler else None
        self.num_microbatches, self.loss_fn, self.step_loss = num_microbatches, loss_fn, step_loss
        self.clip, self.norm_type, self.norm_in_float64 = clip, norm_type, norm_in_float64
        self.precision, self.device, self.forward = precision, device, forward or _whole_model
        self.whole_side, self.loss_side = whole_side, loss_side
        self.skipped: list[bool] = []

    def fit(self, data) -> list[Record]:
        """One step per batch, ``(x, y)`` or ``(x, y, side)``."""
        return [self.step(*batch) for batch in data]

    def step(self, inputs, targets, side=None) -> Record:
        n, side, losses = self.num_microbatches, side or {}, []
        for k, (x, y) in enumerate(zip(inputs.chunk(n), targets.chunk(n), strict=True)):
            part = {key: v if key in self.whole_side else v.chunk(n)[k] for key, v in side.items()}
            loss = self._loss(_on(self.device, x), _on(self.device, y), part)
            (self.scaler.scale(loss / n) if self.scaler else loss / n).backward()
            losses.append(loss.detach())
        lr = self.opt.param_groups[0]["lr"]
        norm = self._clip() if self.clip else None
        if self.scaler:
            before = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.skipped.append(self.scaler.get_scale() < before)
        else:
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.scheduler:
            self.scheduler.step()
        return Record(self.step_loss(losses, n), norm, lr)

    def _loss(self, x, y, side):
        keywords = {key: side[key] for key in self.loss_side}
        if self.precision == "fp32":
            return self.loss_fn(self.forward(self.model, x, side), y, **keywords)
        dtype = DTYPES[self.precision]
        with torch.autocast(torch.device(self.device or "cpu").type, dtype=dtype):
            h = x
            for i, stage in enumerate(self.model):
                h = stage(h)
                if i < len(self.model) - 1:
                    h = h.to(dtype)
            return self.loss_fn(h, y, **keywords)

    def _clip(self) -> float:
        if not self.norm_in_float64:
            return nn.utils.clip_grad_norm_(self.model.parameters(), self.clip, self.norm_type).item()
        norm = nn.utils.get_total_norm([p.grad.double() for p in self.model.parameters()], self.norm_type)
        nn.utils.clip_grads_with_norm_(self.model.parameters(), self.clip, norm)
        return norm.item()


def reference_records(stages, data, num_microbatches: int, loss_fn, optimizer=adamw, **options):
    """``Reference`` over ``data``: the trained model and each step's ``Record``."""
    reference = Reference(stages, num_microbatches, loss_fn, optimizer, **options)
    return reference.model, reference.fit(data)


def reference_train(stages, data, num_microbatches: int, loss_fn, optimizer=adamw, **options):
    """``Reference`` over ``data``: the trained model and each step's loss."""
    model, records = reference_records(stages, data, num_microbatches, loss_fn, optimizer, **options)
    return model, [record.loss for record in records]


def assert_trained_like_reference(losses, params, stages, data, num_microbatches: int, loss_fn, optimizer) -> None:
    """``losses`` and ``params`` (the state dict's values, in order) of a pipeline trained on
    ``data`` equal ``reference_train``'s (float32, tight tolerance)."""
    ref, ref_losses = reference_train(stages, data, num_microbatches, loss_fn, optimizer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for got, want in zip(params, ref.state_dict().values(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
