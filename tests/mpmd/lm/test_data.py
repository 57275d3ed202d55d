"""mpmd train's data: the corpus prepared by Ray Data workers into token files that equal
tokenizing each document in one process (paragraphs cut across units included), the order
and held-out split as pure functions of the step, reuse, and every bad input refused
naming the file with nothing left half written."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mpmd.lm.config import DataConfig, TokenizerConfig
from mpmd.lm.data import EOS, eos_id, load_tokenizer, save_tokenizer, train_tokenizer
from mpmd.lm.corpus import Unit, documents, plan_units
from mpmd.lm.prepare import prepare_data, train_tokenizer_on_sample
from mpmd.lm.tokens import Permutation, PreparedTokens, TokenData, TokenOrder


def _paragraphs(text: str) -> list[str]:
    """A text file's documents, read the plain way: the whole file at once."""
    out, current = [], []
    for line in text.split("\n"):
        line = line[:-1] if line.endswith("\r") else line
        if line.strip():
            current.append(line)
        elif current:
            out.append("\n".join(current))
            current = []
    return out + (["\n".join(current)] if current else [])


TEXT = ("first paragraph\nstill first\n\n\n  \nsecond one, a longer paragraph that runs over a unit's end\n"
        "and on\nand on\n\r\nthird\r\nwith crlf\r\n\n" + "".join(f"para {i} " * (i % 7 + 1) + "\n\n" for i in range(40))
        + "last without newline")


def _tokenizer(tmp_path):
    docs = _paragraphs(TEXT) + ["a jsonl doc", "another", "from parquet"]
    return train_tokenizer(docs * 3, TokenizerConfig(vocab_size=300, min_frequency=1))


@pytest.fixture
def corpus(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text(TEXT)
    with open(tmp_path / "b.jsonl", "w") as f:
        for t in ("a jsonl doc", "", "another"):
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    pq.write_table(pa.table({"text": ["from parquet", "  ", "more rows"]}), tmp_path / "c.parquet", row_group_size=2)
    return tmp_path


def test_units_give_the_documents_of_the_whole_file(corpus):
    """Text cut into units of every size from 1 byte gives the paragraphs of the whole file."""
    want = _paragraphs(TEXT)
    for chunk in (1, 7, 13, 64, 1 << 20):
        cfg = DataConfig(train_files=(str(corpus / "a.txt"),), chunk_mb=chunk / 2 ** 20)
        got = [d for u in plan_units(cfg) for d in documents(u, "text")]
        assert got == want, chunk
    cfg = DataConfig(train_files=(str(corpus / "b.jsonl"), str(corpus / "c.parquet")), chunk_mb=5 / 2 ** 20)
    units = plan_units(cfg)
    assert [u.fmt for u in units].count("parquet") == 2  # row groups
    assert [d for u in units for d in documents(u, "text")] == ["a jsonl doc", "another", "from parquet", "more rows"]


def test_prepared_tokens_equal_tokenizing_each_document(ray_session, corpus, tmp_path):
    tok = _tokenizer(tmp_path)
    cfg = DataConfig(train_files=(str(corpus / "a.txt"), str(corpus / "b.jsonl"), str(corpus / "c.parquet")),
                     chunk_mb=40 / 2 ** 20, workers=2, prepared_dir=str(tmp_path / "prep"))
    logs = []
    tokens = prepare_data(cfg, str(tmp_path / "run"), tok.to_str(), log=logs.append)
    docs = _paragraphs(TEXT) + ["a jsonl doc", "another", "from parquet", "more rows"]
    want = [t for d in docs for t in tok.encode(d, add_special_tokens=False).ids + [eos_id(tok)]]
    assert tokens.read(0, tokens.tokens).tolist() == want
    assert tokens.read(5, 50).tolist() == want[5:55]  # a range across shards
    assert tokens.index["dtype"] == "uint16" and tokens.index["documents"] == len(docs)
    ends = np.concatenate([np.fromfile(os.path.join(tokens.directory, s["docs"]), dtype=np.int64) + start
                           for s, start in zip(tokens.index["shards"], tokens.starts)])
    assert ends.tolist() == np.cumsum([len(tok.encode(d).ids) + 1 for d in docs]).tolist()  # document boundaries
    assert load_tokenizer(os.path.join(tokens.directory, "tokenizer.json")).to_str() == tok.to_str()
    # a rerun finds it; another tokenizer makes another directory
    again = prepare_data(cfg, str(tmp_path / "run"), tok.to_str(), log=logs.append)
    assert again.directory == tokens.directory and "prepared before" in logs[-1]
    other = train_tokenizer(docs * 3, TokenizerConfig(vocab_size=280, min_frequency=1))
    assert prepare_data(cfg, str(tmp_path / "run"), other.to_str(), log=logs.append).directory != tokens.directory
    assert len(os.listdir(tmp_path / "prep")) == 2


def test_bad_input_is_refused_naming_the_file(ray_session, corpus, tmp_path):
    tok = _tokenizer(tmp_path)
    root = tmp_path / "prep"

    def prepare(*files, **kw):
        cfg = DataConfig(train_files=tuple(str(f) for f in files), prepared_dir=str(root), workers=1, **kw)
        return prepare_data(cfg, str(tmp_path / "run"), tok.to_str(), log=lambda *a: None)

    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ValueError, match="empty.txt is empty; remove it"):
        prepare(corpus / "a.txt", tmp_path / "empty.txt")
    (tmp_path / "latin.txt").write_bytes(b"fine text\n\ncaf\xe9 au lait\n")
    with pytest.raises(ValueError, match=r"latin.txt: byte 14 is not UTF-8 .*iconv"):
        prepare(corpus / "a.txt", tmp_path / "latin.txt")
    assert not root.exists() or os.listdir(root) == []  # nothing written half
    with pytest.raises(ValueError, match="b.jsonl has no column 'body'"):
        prepare(corpus / "b.jsonl", text_key="body")
    with pytest.raises(ValueError, match="c.parquet has no column 'body'"):
        prepare(corpus / "c.parquet", text_key="body")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl: the line at byte 15 is not JSON"):
        prepare(tmp_path / "bad.jsonl")
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(ValueError, match="cannot tell the format of .*d.csv"):
        prepare(tmp_path / "d.csv")
    assert not root.exists() or os.listdir(root) == []

    tokens = prepare(corpus / "a.txt")
    with pytest.raises(ValueError, match="too few for a validation batch and a training batch of "
                                         "optim.batch_size=64; add data"):
        TokenData(tokens, seq_len=16, batch_size=64, val_fraction=0.1, eval_batches=1, seed=0)
    index_path = os.path.join(tokens.directory, "index.json")
    with open(index_path) as f:
        index = json.load(f)
    index["vocab_size"] += 1
    with open(index_path, "w") as f:
        json.dump(index, f)
    with pytest.raises(ValueError, match="was made with another tokenizer .* run `mpmd prepare-data CONFIG` again"):
        prepare(corpus / "a.txt")
    index["vocab_size"] -= 1
    with open(index_path, "w") as f:
        json.dump(index, f)
    shard = os.path.join(tokens.directory, index["shards"][0]["file"])
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 2)
    with pytest.raises(ValueError, match=r"shard-000000.bin is .* bytes where the index says .* delete"):
        prepare(corpus / "a.txt")
    with pytest.raises(FileNotFoundError, match="is not prepared data here; run `mpmd prepare-data CONFIG`"):
        PreparedTokens(str(tmp_path / "nowhere"))


def test_the_tokenizer_is_trained_on_a_bounded_sample(ray_session, corpus):
    cfg = DataConfig(train_files=(str(corpus / "a.txt"),), chunk_mb=400 / 2 ** 20)
    units = plan_units(cfg)
    _, all_docs = train_tokenizer_on_sample(units, cfg, TokenizerConfig(vocab_size=280, min_frequency=1))
    _, some = train_tokenizer_on_sample(units, cfg, TokenizerConfig(vocab_size=280, min_frequency=1,
                                                                    sample_mb=200 / 2 ** 20))
    assert all_docs == len(_paragraphs(TEXT)) and 0 < some < all_docs / 2
    with pytest.raises(ValueError, match="hold no text"):
        train_tokenizer_on_sample([Unit(0, str(corpus / "b.jsonl"), "jsonl", 0, 0, 0)], cfg, TokenizerConfig())


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 1000, 1025])
def test_permutation_is_a_keyed_bijection(n):
    p = Permutation(n, (0, 1))
    assert sorted(p(np.arange(n)).tolist()) == list(range(n))
    if n >= 64:
        assert p(np.arange(n)).tolist() != Permutation(n, (0, 2))(np.arange(n)).tolist()
        assert p(np.arange(n)).tolist() != list(range(n))
    with pytest.raises(IndexError):
        p([n])


def test_batches_are_a_function_of_the_step():
    order = TokenOrder(sequences=100, seq_len=4, batch_size=8, val=8, seed=3)
    again = TokenOrder(sequences=100, seq_len=4, batch_size=8, val=8, seed=3)
    assert order.train == 92 and order.per_epoch == 11
    for step in (30, 0, 5, 11):  # the same batch whatever came before (resume skips exactly)
        assert (order.train_sequences(step) == again.train_sequences(step)).all()
    epoch = np.concatenate([order.train_sequences(s) for s in range(11)])
    assert len(set(epoch.tolist())) == 88  # no sequence twice within an epoch
    assert not set(order.val_sequences().tolist()) & set(order.split(8 + np.arange(92)).tolist())  # held out
    assert not (order.train_sequences(0) == order.train_sequences(11)).all()  # the next epoch is reshuffled
    assert (order.train_sequences(7, 2, 6) == order.train_sequences(7)[2:6]).all()  # a replica's rows


def test_a_users_tokenizer(tmp_path):
    tok = train_tokenizer(["some text here"] * 5, TokenizerConfig(vocab_size=280, min_frequency=1))
    path = save_tokenizer(tok, str(tmp_path))
    assert load_tokenizer(path).encode("some text").ids == tok.encode("some text").ids
    assert TokenizerConfig(path=path).path == path
    assert tok.token_to_id(EOS) is not None


def test_mpmd_prepare_data(ray_session, corpus, tmp_path, capsys):
    """``mpmd prepare-data CONFIG``: the tokenizer trained and saved in the run, the corpus
    prepared where ``mpmd train`` looks for it; bad input is an error line and exit code 2."""
    from mpmd.cli import main

    sets = [f"data.train_files=[{str(corpus / 'a.txt')!r}]", f"run.dir={str(tmp_path / 'run')!r}",
            "tokenizer.vocab_size=280", "data.seq_len=8", "optim.batch_size=4", "optim.warmup_steps=1",
            "parallel.microbatches=2"]
    argv = ["prepare-data", "configs/debug.toml"] + [x for s in sets for x in ("--set", s)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "tokenizer: byte-level BPE of 280 tokens" in out and "63 training and 8 validation sequences of 8 tokens" in out
    prepared = os.listdir(tmp_path / "run" / "prepared")
    assert len(prepared) == 1 and os.path.isfile(tmp_path / "run" / "tokenizer" / "tokenizer.json")
    assert main(argv) == 0 and "prepared before" in capsys.readouterr().out
    (tmp_path / "empty.txt").write_text("")
    assert main(argv + ["--set", f"data.train_files=[{str(tmp_path / 'empty.txt')!r}]"]) == 2
    assert "empty.txt is empty" in capsys.readouterr().err


def test_reads_across_shards_keep_few_maps(ray_session, corpus, tmp_path, monkeypatch):
    """A read across many shards maps them one at a time, at most ``_OPEN_MAPS`` at once."""
    from mpmd.lm import tokens as tokens_module

    tok = _tokenizer(tmp_path)
    cfg = DataConfig(train_files=(str(corpus / "a.txt"),), chunk_mb=30 / 2 ** 20, workers=1,
                     prepared_dir=str(tmp_path / "prep"))
    prepared = prepare_data(cfg, str(tmp_path / "run"), tok.to_str(), log=lambda *a: None)
    assert len(prepared.index["shards"]) > 8
    want = prepared.read(0, prepared.tokens)
    monkeypatch.setattr(tokens_module, "_OPEN_MAPS", 3)
    fresh = PreparedTokens(prepared.directory)
    assert (fresh.read(0, fresh.tokens) == want).all() and fresh.mapped == 3
