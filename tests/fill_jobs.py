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
