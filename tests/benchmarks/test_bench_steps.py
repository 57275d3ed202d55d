"""``python -m mpmd bench steps``' parts on tiny configs: the config's checks, the single-process,
torch.distributed.pipelining and fit rows, and the packed batches the step calls carry."""

from __future__ import annotations

import pytest


def test_bench_config_is_validated():
    from benchmarks.bench import BenchConfig

    with pytest.raises(ValueError, match="divisible by microbatches"):
        BenchConfig(batch_size=30, microbatches=8)
    with pytest.raises(ValueError, match="unknown schedule"):
        BenchConfig(schedules=("nope",))
    with pytest.raises(ValueError, match="raise n_layers"):
        BenchConfig(schedules=("interleaved-1f1b",), actors=4, n_layers=4)


TINY = dict(schedules=("1f1b",), steps=1, warmup=0, batch_size=4, microbatches=2, seq_len=8, d_model=16, n_layers=2,
            dispatch_microbatches=())


def test_bench_single_process_row():
    from benchmarks.bench import BenchConfig, measure_single

    times = measure_single(BenchConfig(**TINY))
    assert len(times) == 1 and times[0] > 0


def test_bench_torch_pipelining_row():
    # Two spawned processes with a tiny GPT: seconds on an idle machine.
    from benchmarks.bench import BenchConfig, measure_torch

    cfg = BenchConfig(**TINY)
    times = measure_torch(cfg, "1f1b")
    assert len(times) == 1 and times[0] > 0
    assert measure_torch(cfg, "zb-h2") is None  # torch has no such schedule: the row says n/a


def test_bench_fit_row_compares_with_torch_by_the_median_of_paired_rounds(ray_session):
    # Two rounds of (torch, our fit loop), back to back on one set of actors.
    from benchmarks.bench import BenchConfig, measure_schedule, table_steps

    cfg = BenchConfig(**TINY, rounds=2)
    got = measure_schedule(cfg, "1f1b", progress=lambda msg: None)
    assert len(got["rounds"]) == 2 and all(r > 0 for r in got["rounds"])
    assert len(got["torch"]) == 2 * cfg.steps
    lines = table_steps(cfg, {"single": 1.0, "schedules": {"1f1b": got}})
    fit_row = next(line for line in lines if "mpmd fit" in line)
    median = sorted(got["rounds"])[0] / 2 + sorted(got["rounds"])[1] / 2
    assert f"{median:.2f}x" in fit_row.split()
    assert any(line.startswith("1f1b: fit vs torch per round") for line in lines)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        BenchConfig(**TINY, rounds=0)


def test_packed_batch_round_trips_through_pickle():
    # The controller ships microbatches stacked, as numpy arrays (cheap to serialize); see PackedBatch.
    import pickle

    import torch

    from actors.values import PackedBatch, pack_batch, unpack_batch

    def mb(i):
        return (torch.randn(2, 3) + i, {"ids": torch.arange(4) + i, "extra": [torch.ones(2, dtype=torch.bfloat16) * i,
                                                                             torch.tensor([i % 2 == 0])]})

    batch = [mb(i) for i in range(3)]
    packed = pack_batch(batch)
    assert isinstance(packed, PackedBatch) and packed.count == 3 and len(packed.arrays) == 4
    back = unpack_batch(pickle.loads(pickle.dumps(packed)))
    assert len(back) == 3
    for got, want in zip(back, batch, strict=True):
        assert isinstance(got, tuple) and isinstance(got[1]["extra"], list)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1]["ids"], want[1]["ids"])
        assert torch.equal(got[1]["extra"][0], want[1]["extra"][0]) and got[1]["extra"][0].dtype == torch.bfloat16
        assert torch.equal(got[1]["extra"][1], want[1]["extra"][1])
    ragged = [torch.zeros(2, 3), torch.zeros(1, 3)]  # e.g. token slices of different lengths
    assert pack_batch(ragged) is ragged and unpack_batch(ragged) is ragged
    assert pack_batch(None) is None and unpack_batch(None) is None


def test_small_packed_batches_travel_as_bytes_and_large_ones_as_arrays():
    import torch

    from actors.values import INLINE_BYTES, PackedBatch, pack_batch, to_rpc, unpack_batch

    small = [torch.arange(6).reshape(2, 3) + i for i in range(4)]
    wire = to_rpc(pack_batch(small))
    assert isinstance(wire, bytes)
    assert all(torch.equal(a, b) for a, b in zip(unpack_batch(wire), small, strict=True))
    large = [torch.zeros(INLINE_BYTES // 4 + 1) for _ in range(2)]  # float32: over the limit together
    assert isinstance(to_rpc(pack_batch(large)), PackedBatch)
    bf16 = [torch.ones(3, dtype=torch.bfloat16)]  # no numpy dtype: stays a tensor, not inlined
    assert isinstance(to_rpc(pack_batch(bf16)), PackedBatch)
    assert to_rpc(None) is None
