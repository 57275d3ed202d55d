"""The body of test_tp_memory.py: each of two gloo processes runs one microbatch (forward, loss,
backward) of each stage of a Llama split in two (4 decoder layers each), whole and then sharded by the built-in plan
(``loss_parallel``: the last stage's logits over the vocabulary), and measures the peak of the
bytes live in torch's CPU allocator during it (the profiler's allocation events, what CUDA's
``max_memory_allocated`` counts on a GPU); rank 0 writes them."""

from __future__ import annotations

import contextlib
import copy
import pickle

import torch
import torch.distributed as dist
from torch.distributed.tensor.parallel import loss_parallel
from torch.profiler import ProfilerActivity, profile

from actors.tensor_parallel import apply_plan
from mpmd.planning import partition
from mpmd.planning.hf import causal_lm_loss, split_causal_lm
from mpmd.tensor_parallel import resolve_plans

from .tp_worker import tp_group

VOCAB, HIDDEN, SEQ, BATCH = 4096, 128, 512, 8  # one microbatch: 4096 tokens; its logits are 64 MiB in float32


def llama_stages():
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                                   num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=SEQ, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    return split_causal_lm(model, 2, [4, 4], balancer=partition)[0]


def peak_bytes(stage, s: int, sharded: bool) -> int:
    """The allocator's peak live bytes above the start over one microbatch of stage ``s``."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    x = ids if s == 0 else torch.randn(BATCH, SEQ, HIDDEN, generator=g, requires_grad=True)
    out_grad = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with loss_parallel() if sharded else contextlib.nullcontext():
            out = stage(x)
            if s == 1:
                causal_lm_loss(out, ids).backward()
            else:
                out.backward(out_grad)
        del out
    live = peak = 0
    for event in sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns()):
        if event.name() == "[memory]" and event.device_type().name == "CPU":
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def main(rank: int, world: int, port: int, out_path: str) -> None:
    with tp_group(rank, world, port) as mesh:
        stages = llama_stages()
        plans = resolve_plans(stages, "auto", world, loss_parallel=True)
        result = {}
        for s, stage in enumerate(stages):
            whole = peak_bytes(copy.deepcopy(stage), s, sharded=False)
            apply_plan(stage, plans[s], mesh, s)
            result[s] = (whole, peak_bytes(stage, s, sharded=True))
        every = [None] * world
        dist.all_gather_object(every, result)
        if rank == 0:
            with open(out_path, "wb") as f:
                pickle.dump(every, f)
