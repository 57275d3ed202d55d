"""Fill-job functions for the PipeFill tests (importable by actor processes)."""

import torch

_side = None


def side_model() -> torch.nn.Module:
    global _side
    if _side is None:
        torch.manual_seed(5)
        _side = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return _side


def infer(batch: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return side_model()(batch)


def explode_on_negative(batch: torch.Tensor) -> torch.Tensor:
    if (batch < -100).any():
        raise RuntimeError("fill boom")
    return batch * 2


def reseed_and_draw(batch: torch.Tensor) -> torch.Tensor:
    """Reseeds and draws from the global RNG, as careless fill code does."""
    torch.manual_seed(123)
    return batch + torch.rand(batch.shape)


def scale_and_shift(batch: torch.Tensor) -> torch.Tensor:
    """Deterministic and per input: chunked anywhere, the outputs equal one in-process call."""
    return batch * 3 - 1


def double_on_cuda(batch: torch.Tensor) -> tuple:
    """On the actor's GPU, drawing from its RNG (the main job's dropout must not notice): the
    outputs (2x) and, per input, 1.0 when it was computed on CUDA."""
    y = batch.to("cuda")
    noise = torch.randn_like(y)  # a draw from the CUDA generator
    return y * 2 + 0 * noise, torch.full((y.shape[0],), float(y.is_cuda), device=y.device)
