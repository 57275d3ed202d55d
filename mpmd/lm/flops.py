"""Model FLOPs utilisation (MFU) of ``mpmd train``.

Note [MFU]: a training token costs ``6 * N + 12 * L * H * T`` FLOPs (the PaLM paper's
appendix B and torchtitan's count): ``N`` the parameters that multiply (every parameter but
the input embedding table, which is a lookup; the LM head counts), 6 = 2 (multiply-add)
x 3 (forward, input gradient, weight gradient); ``12 * L * H * T`` the attention scores and
their weighted sum (QK^T and AV, 2 matmuls of 2 FLOPs per multiply-add, x3 for training)
over ``L`` layers of width ``H`` at sequence length ``T``: each token's query against ``T``
keys, the full square.  A causal model's query at position ``t`` attends to ``t + 1`` keys, so a
sequence has ``T (T + 1) / 2`` (query, key) pairs: half the square and half its diagonal, and
``mpmd train`` counts that (``causal=True``: ``(T + 1) / 2`` keys per token, the attention term
``6 * L * H * (T + 1)``), which at long sequences is most of the work (at ``T = 131072`` an
8B Llama's causal attention term is 2.3x its ``6 N``, and counting the full square would
overstate its FLOPs, and MFU, 1.7x; 2x as ``T`` grows).  Packed documents that attend only within themselves
(``data.document_mask``) have ``sum(d (d + 1) / 2)`` pairs over their lengths ``d``: each token
at position ``p`` of its document attends to ``p + 1`` keys, so the mean keys per token is
the mean of ``position_ids + 1`` over the batch (``document_keys_per_token``), per step.
Recomputation is not counted (model FLOPs, not hardware FLOPs).  A mixture of experts counts
its *active* parameters (as DeepSeek-V3's "37B activated" and Qwen3's "A22B" do): of a MoE
layer's routed experts only the ``top_k`` each token goes to (``model.experts_per_token``), plus the router and
the shared experts; the first ``dense_layers`` count their dense MLP.  Its attention term is
``6 * L * T * (query-key width + value width)`` (``12 * L * H * T`` when both are ``H``):
multi-head latent attention's heads are ``qk_nope + qk_rope`` wide for the scores and
``v_head_dim`` for the sum; its low-rank projections are in ``N``.

MFU = tokens/s x FLOPs/token / (devices x peak FLOP/s per device), the peak from
``run.peak_flops`` if given, else the table below for a known GPU (dense, no sparsity),
else a matmul measured on this CPU in one thread (each actor runs with one CPU)."""

from __future__ import annotations

import time
from typing import Optional

import torch

from .models import LlamaSpec

__all__ = ["flops_per_token", "document_keys_per_token", "layer_matmul_params", "layer_norm_params",
           "attention_widths", "GPU_PEAK_FLOPS", "peak_flops", "measured_cpu_peak", "mfu"]

# Dense peak FLOP/s by device name substring and precision (vendor data sheets, SXM parts).
GPU_PEAK_FLOPS = {
    "H200": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "H100": {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12},
    "L40S": {"bf16": 362e12, "fp16": 362e12, "fp32": 91.6e12},
    "A10": {"bf16": 125e12, "fp16": 125e12, "fp32": 31.2e12},
}


def layer_matmul_params(spec: LlamaSpec, index: int = 0, active: bool = False) -> int:
    """The parameters of decoder layer ``index`` that multiply (its matrices; Note [MFU]); with
    ``active``, of a MoE layer's routed experts only the ``top_k`` a token uses."""
    h, m, a = spec.hidden_size, spec.moe, spec.moe_shape
    if spec.family == "gpt":  # the demo GPT: attention 4h^2, MLP 8h^2 per layer, untied head
        return 12 * h * h
    if spec.family == "deepseek_v3":  # latent attention: q_a, q_b (or q_proj); kv_a, kv_b; o
        heads, qk = spec.num_heads, a.qk_nope_head_dim + a.qk_rope_head_dim
        q = h * a.q_lora_rank + a.q_lora_rank * heads * qk if a.q_lora_rank else h * heads * qk
        attention = (q + h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank * heads * (a.qk_nope_head_dim
                     + a.v_head_dim) + heads * a.v_head_dim * h)
    else:  # q, o; k, v
        d = spec.head_dim
        attention = 2 * h * spec.num_heads * d + 2 * h * spec.num_kv_heads * d
    if m is None or not m.is_moe_layer(index):
        return attention + 3 * h * spec.intermediate_size  # gate, up, down
    routed = m.top_k if active else m.num_experts
    return attention + m.replicated_params(h) + m.expert_params(h) // m.num_experts * routed


def layer_norm_params(spec: LlamaSpec) -> int:
    """A decoder layer's RMSNorm weights: two of ``hidden``, and Qwen3's per-head query and key
    norms or DeepSeek-V3's norms of the latent query and key/value."""
    extra = {"qwen3_moe": lambda a: 2 * spec.head_dim,
             "deepseek_v3": lambda a: (a.q_lora_rank or 0) + a.kv_lora_rank}.get(spec.family)
    return 2 * spec.hidden_size + (extra(spec.moe_shape) if extra else 0)


def attention_widths(spec: LlamaSpec) -> tuple[int, int]:
    """(query-key width, value width) summed over the heads: ``hidden`` both for Llama."""
    a = spec.moe_shape
    if spec.family == "deepseek_v3":
        return spec.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim), spec.num_heads * a.v_head_dim
    if a is not None:
        return spec.num_heads * spec.head_dim, spec.num_heads * spec.head_dim
    return spec.hidden_size, spec.hidden_size


def flops_per_token(spec: LlamaSpec, seq_len: int, *, causal: bool = False,
                    keys_per_token: Optional[float] = None) -> float:
    """Note [MFU]: training FLOPs per token, a mixture of experts' active parameters only.  Each
    token's query attends to ``keys_per_token`` keys: by default ``seq_len`` (the full square,
    PaLM's count), ``(seq_len + 1) / 2`` with ``causal``, or as given (packed documents:
    ``document_keys_per_token``)."""
    h, layers, v = spec.hidden_size, spec.num_layers, spec.vocab_size
    # the layers' matrices + the LM head (norms are not matmuls, left out)
    n = sum(layer_matmul_params(spec, i, active=True) for i in range(layers)) + h * v
    if keys_per_token is None:
        keys_per_token = (seq_len + 1) / 2 if causal else seq_len
    return 6.0 * n + 6.0 * layers * sum(attention_widths(spec)) * keys_per_token


def document_keys_per_token(position_ids: torch.Tensor) -> float:
    """The mean number of keys a token attends to when packed documents attend within
    themselves and causally: a token at position ``p`` of its document sees ``p + 1`` (Note [MFU])."""
    return float((position_ids.double() + 1).mean())


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
