"""Model FLOPs utilisation (MFU) of ``mpmd train``.

Note [MFU]: a training token costs ``6 * N + 12 * L * H * T`` FLOPs (the PaLM paper's
appendix B and torchtitan's count): ``N`` the parameters that multiply (every parameter but
the input embedding table, which is a lookup; the LM head counts), 6 = 2 (multiply-add)
x 3 (forward, input gradient, weight gradient); ``12 * L * H * T`` the attention scores and
their weighted sum (QK^T and AV, 2 matmuls of 2 FLOPs per multiply-add, x3 for training)
over ``L`` layers of width ``H`` at sequence length ``T``, causal masking not discounted.
Recomputation is not counted (model FLOPs, not hardware FLOPs).

MFU = tokens/s x FLOPs/token / (devices x peak FLOP/s per device), the peak from
``run.peak_flops`` if given, else the table below for a known GPU (dense, no sparsity),
else a matmul measured on this CPU in one thread (each actor runs with one CPU)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from .models import LlamaSpec

__all__ = ["flops_per_token", "layer_matmul_params", "GPU_PEAK_FLOPS", "peak_flops", "measured_cpu_peak", "mfu"]

# Dense peak FLOP/s by device name substring and precision (vendor data sheets, SXM parts).
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
}


def layer_matmul_params(spec: LlamaSpec) -> int:
    """The parameters of one decoder layer that multiply (its matrices; Note [MFU])."""
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    if spec.family == "gpt":  # the demo GPT: attention 4h^2, MLP 8h^2 per layer, untied head
        return 12 * h * h
    return 2 * h * h + 2 * h * kv + 3 * h * spec.intermediate_size  # q, o; k, v; gate, up, down


def flops_per_token(spec: LlamaSpec, seq_len: int) -> float:
    """Note [MFU]."""
    h, layers, v = spec.hidden_size, spec.num_layers, spec.vocab_size
    n = layers * layer_matmul_params(spec) + h * v  # + the LM head (norms are not matmuls, left out)
    return 6.0 * n + 12.0 * layers * h * seq_len


def measured_cpu_peak(size: int = 512, repeats: int = 8) -> float:
    """FLOP/s of a float32 ``size`` x ``size`` matmul in one thread, the best of ``repeats``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return 2.0 * size ** 3 / best


def peak_flops(device: str, precision: str, override: Optional[float] = None) -> tuple[Optional[float], str]:
    """Per-device peak FLOP/s and where it came from (None: unknown, no MFU)."""
    if override is not None:
        return float(override), "run.peak_flops"
    if device == "cuda":
        if not torch.cuda.is_available():
            return None, "the controller sees no GPU to name; set run.peak_flops (FLOP/s per GPU) for MFU"
        name = torch.cuda.get_device_name(0)
        for key, table in GPU_PEAK_FLOPS.items():
            if key in name:
                return table[precision], f"{name} data sheet ({precision})"
        return None, f"no peak FLOP/s known for {name!r}; set run.peak_flops (FLOP/s per GPU) for MFU"
    return measured_cpu_peak(), "measured float32 matmul, one CPU thread"


def mfu(tokens_per_s: float, flops_token: float, devices: int, peak: float) -> float:
    return tokens_per_s * flops_token / (devices * peak)
