"""What one microbatch's activations and logits take on a tensor-parallel Llama rank, measured
by torch's CPU allocator (the peak of live bytes over a forward, the loss and the backward:
what ``torch.cuda.max_memory_allocated`` counts on a GPU), tp=2 against the whole stage on the
same microbatch.  The built-in plan shards the norms and the residual stream over the sequence
(Note [sequence parallelism] in mpmd/tensor_parallel/builtin.py) and, with
``loss_parallel=True``, the logits and the loss's buffers over the vocabulary (Note
[vocabulary-parallel loss]; mpmd.planning.causal_lm_loss reduces them on the shards): each rank
then peaks at most 0.6x the whole stage.  Exactness is test_tp_exact.py's and
tests/mpmd/tensor_parallel/test_tensor_parallel.py's.  No Ray; one spawn (memory_worker.py)."""

from __future__ import annotations

import pickle
import socket

import pytest
import torch.multiprocessing as mp

from . import memory_worker

pytest.importorskip("transformers")


def test_a_tp_rank_peaks_at_most_six_tenths_of_the_whole_stage(tmp_path):
    out = tmp_path / "peaks.pkl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(memory_worker.main, args=(2, port, str(out)), nprocs=2, join=True)
    with open(out, "rb") as f:
        ranks = pickle.load(f)
    table = {s: [round(ranks[0][s][0] / 2 ** 20, 1)] + [round(r[s][1] / 2 ** 20, 1) for r in ranks] for s in (0, 1)}
    print(f"peak live MiB per stage (whole, then tp=2 ranks 0 and 1): {table}")
    for s in (0, 1):
        whole = ranks[0][s][0]
        assert whole > 48 * 2 ** 20, table  # a microbatch large enough to measure
        for r in ranks:
            assert r[s][1] <= 0.6 * whole, (s, table)
