"""mpmd train's data: formats read with Ray Data, EOS packing, the held-out split, batches by step."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mpmd.lm.config import DataConfig, TokenizerConfig
from mpmd.lm.data import EOS, LMData, load_tokenizer, pack, read_documents, save_tokenizer, train_tokenizer


def test_batches_are_a_function_of_the_step():
    seqs = np.arange(100 * 4).reshape(100, 4)
    data = LMData(seqs, batch_size=8, val_fraction=0.1, eval_batches=2, seed=3)
    assert len(data.val) == 8 and len(data.train) == 92 and data.per_epoch == 11
    again = LMData(seqs, batch_size=8, val_fraction=0.1, eval_batches=2, seed=3)
    for step in (0, 5, 11, 30):  # the same batch whatever came before (resume skips exactly)
        assert (data.batch(step)[0] == again.batch(step)[0]).all()
    epoch = np.concatenate([data.batch(s)[0][:, 0].numpy() for s in range(11)])
    assert len(set(epoch)) == 88  # no sequence twice within an epoch
    held = set(data.val[:, 0])
    assert not held & set(data.train[:, 0])  # validation is held out
    assert not (data.batch(0)[0] == data.batch(11)[0]).all()  # the next epoch is reshuffled
    with pytest.raises(ValueError, match="too few for a validation batch and a training batch of optim.batch_size=64"):
        LMData(seqs, batch_size=64, val_fraction=0.1, eval_batches=1, seed=0)


def test_pack_puts_eos_between_documents():
    docs = ["hello world", "pipeline stages", "hello pipeline"] * 20
    tok = train_tokenizer(docs, TokenizerConfig(vocab_size=300, min_frequency=1))
    eos = tok.token_to_id(EOS)
    seqs = pack(docs[:3], tok, seq_len=4)
    flat = [t for row in seqs for t in row]
    ids = [t for d in docs[:3] for t in tok.encode(d).ids + [eos]]
    assert flat == ids[:len(flat)] and len(flat) == len(ids) // 4 * 4
    assert tok.decode(tok.encode("hello world").ids) == "hello world"


def test_formats_read_with_ray_data(ray_session, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("first paragraph\nstill first\n\nsecond one\n")
    with open(tmp_path / "b.jsonl", "w") as f:
        for t in ("a jsonl doc", "another"):
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": ["from parquet"]}), tmp_path / "c.parquet")
    cfg = DataConfig(train_files=(str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), str(tmp_path / "c.parquet")))
    assert read_documents(cfg) == ["first paragraph\nstill first", "second one", "a jsonl doc", "another",
                                   "from parquet"]
    with pytest.raises(ValueError, match="has no column 'body'"):
        read_documents(DataConfig(train_files=(str(tmp_path / "b.jsonl"),), text_key="body"))
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format of .*d.csv"):
        read_documents(DataConfig(train_files=(str(tmp_path / "d.csv"),)))


def test_a_users_tokenizer(tmp_path):
    tok = train_tokenizer(["some text here"] * 5, TokenizerConfig(vocab_size=280, min_frequency=1))
    path = save_tokenizer(tok, str(tmp_path))
    assert load_tokenizer(path).encode("some text").ids == tok.encode("some text").ids
    assert TokenizerConfig(path=path).path == path
