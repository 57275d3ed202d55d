"""Files are checked before they are trusted (Note [names from files] in actors/file_checks.py):
a prepared index's dtype and shard names, a safetensors index's file names, a FIFO where a
file should be; stale temporary directories of prepare-data swept (Note [stale prepare
directories]); ``mpmd export`` needing none of the training machine's data files, and
checking what it needs before it writes."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from mpmd.lm.config import DataConfig, TokenizerConfig
from mpmd.lm.data import builtin_path, save_tokenizer, train_tokenizer
from mpmd.lm.prepare import prepare_data, temporary_path
from mpmd.lm.tokens import PreparedTokens

TOKENS = np.arange(40, dtype=np.uint16)


@contextlib.contextmanager
def _fails_if_blocked(seconds: int = 20):
    """A FIFO opened for reading blocks until a writer comes: make that a failure, not a hung
    suite (the alarm interrupts the blocked open in this, the main, thread)."""
    def blocked(*_):
        raise AssertionError(f"blocked for {seconds} s: a FIFO was opened")

    previous = signal.signal(signal.SIGALRM, blocked)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _prepared(directory, **shard) -> str:
    """A prepared directory as prepare-data writes one (one shard of ``TOKENS``, 2 documents),
    its shard entry changed by ``shard``."""
    os.makedirs(directory, exist_ok=True)
    TOKENS.tofile(os.path.join(directory, "shard-000000.bin"))
    np.array([20, 40], dtype=np.int64).tofile(os.path.join(directory, "shard-000000.idx"))
    entry = {"file": "shard-000000.bin", "docs": "shard-000000.idx", "tokens": 40, "documents": 2, **shard}
    index = {"version": 1, "dtype": "uint16", "tokens": 40, "documents": 2, "shards": [entry]}
    with open(os.path.join(directory, "index.json"), "w") as f:
        json.dump(index, f)
    return str(directory)


def _set_index(directory, **changes) -> None:
    path = os.path.join(directory, "index.json")
    with open(path) as f:
        index = json.load(f)
    index.update(changes)
    with open(path, "w") as f:
        json.dump(index, f)


def test_a_well_formed_prepared_directory_reads(tmp_path):
    tokens = PreparedTokens(_prepared(tmp_path / "p"))
    tokens.check()
    assert tokens.read(3, 10).tolist() == list(range(3, 13))


@pytest.mark.parametrize("dtype", ["O", "object", "int64", "float32", "<u2", ["uint16"], None])
def test_a_dtype_prepare_data_does_not_write_is_refused(tmp_path, dtype):
    """dtype "O" would make numpy read the file's bytes as object pointers (a crash)."""
    directory = _prepared(tmp_path / "p")
    _set_index(directory, dtype=dtype)
    with pytest.raises(ValueError, match=r"index.json: dtype .* is not a token dtype mpmd prepare-data writes "
                                         r"\(uint16, uint32\); delete .* and run `mpmd prepare-data CONFIG` again"):
        PreparedTokens(directory)


@pytest.mark.parametrize("field, name", [
    ("file", "../x.bin"), ("file", "/etc/passwd.bin"), ("file", "sub/shard.bin"), ("file", ".."),
    ("file", "shard-000000.idx"), ("file", 7), ("docs", "../shard-000000.idx"), ("docs", "/tmp/x.idx"),
    ("docs", "shard-000000.bin")])
def test_a_shard_name_that_is_not_a_plain_name_of_the_directory_is_refused(tmp_path, field, name):
    (tmp_path / "x.bin").write_bytes(TOKENS.tobytes())  # what "../x.bin" would read
    directory = _prepared(tmp_path / "p", **{field: name})
    with pytest.raises(ValueError, match=rf"index.json: shards\[0\]\.{field} is .*, not a plain file name ending in "
                                         rf"\.(bin|idx) .*; delete .* and run `mpmd prepare-data CONFIG` again"):
        PreparedTokens(directory)


def test_a_bad_count_or_shape_of_index_is_refused(tmp_path):
    directory = _prepared(tmp_path / "p", tokens="40")
    with pytest.raises(ValueError, match=r"shards\[0\]\.tokens is '40', not a count; delete"):
        PreparedTokens(directory)
    _set_index(directory, shards={"file": "shard-000000.bin"})
    with pytest.raises(ValueError, match=r"not a prepared-data index \(an object with a list of \"shards\"\)"):
        PreparedTokens(directory)
    with open(os.path.join(directory, "index.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match=r"index.json is not JSON .*; delete"):
        PreparedTokens(directory)


def test_a_fifo_in_place_of_a_shard_or_the_index_is_refused_without_blocking(tmp_path):
    """Opening a FIFO for reading waits for a writer: the check must not open it (nor map it)."""
    directory = _prepared(tmp_path / "p")
    tokens = PreparedTokens(directory)
    os.remove(os.path.join(directory, "shard-000000.bin"))
    os.mkfifo(os.path.join(directory, "shard-000000.bin"))
    with _fails_if_blocked():
        with pytest.raises(ValueError, match=r"shard-000000.bin is a FIFO, not a regular file; delete .* and run "
                                             r"`mpmd prepare-data CONFIG` again"):
            tokens.check()
        with pytest.raises(ValueError, match="shard-000000.bin is a FIFO, not a regular file"):
            tokens.read(0, 4)
        os.remove(os.path.join(directory, "index.json"))
        os.mkfifo(os.path.join(directory, "index.json"))
        with pytest.raises(ValueError, match="index.json is a FIFO, not a regular file; delete"):
            PreparedTokens(directory)


def test_a_directory_in_place_of_a_shard_is_refused(tmp_path):
    directory = _prepared(tmp_path / "p")
    os.remove(os.path.join(directory, "shard-000000.idx"))
    os.mkdir(os.path.join(directory, "shard-000000.idx"))
    with pytest.raises(ValueError, match="shard-000000.idx is a directory, not a regular file"):
        PreparedTokens(directory).check()


# -- Hugging Face weight maps ------------------------------------------------------------------------
def _model_dir(tmp_path, weight_map: dict) -> str:
    from safetensors.torch import save_file

    directory = tmp_path / "model"
    directory.mkdir()
    save_file({"w": torch.ones(2, 2)}, str(directory / "model-00001-of-00001.safetensors"))
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return str(directory)


@pytest.mark.parametrize("file, why", [
    ("../x.safetensors", "not a plain file name ending in .safetensors"),
    ("/tmp/x.safetensors", "not a plain file name ending in .safetensors"),
    ("model-00001-of-00001.bin", "not a plain file name ending in .safetensors"),
    (["model-00001-of-00001.safetensors"], "not a plain file name ending in .safetensors"),
    ("missing.safetensors", "names missing.safetensors, which .* lacks"),
    ("fifo.safetensors", "fifo.safetensors is a FIFO, not a regular file")])
def test_a_weight_map_entry_outside_the_directory_is_refused_before_anything_is_read(tmp_path, monkeypatch,
                                                                                      file, why):
    """``load_safetensors`` refuses the index before it asks the engine for anything or opens a
    weight file (the engine here has nothing but ``check_open``)."""
    import safetensors

    from mpmd.training.export import load_safetensors

    from safetensors.torch import save_file

    save_file({"w": torch.ones(2, 2)}, str(tmp_path / "x.safetensors"))  # what "../x.safetensors" would read
    directory = _model_dir(tmp_path, {"w": "model-00001-of-00001.safetensors", "v": file})
    os.mkfifo(os.path.join(directory, "fifo.safetensors"))
    monkeypatch.setattr(safetensors, "safe_open", lambda *a, **k: pytest.fail("a weight file was opened"))
    engine = types.SimpleNamespace(fleet=types.SimpleNamespace(check_open=lambda: None))  # refused before the actors
    with _fails_if_blocked(), pytest.raises(ValueError, match=rf"model.safetensors.index.json(: weight_map\['v'\] is .*)? .*{why}.*; "
                                         rf"give a model directory whose model.safetensors.index.json names its own "
                                         rf"\.safetensors files"):
        load_safetensors(engine, directory)


def test_the_actor_checks_the_weight_map_it_is_given(tmp_path):
    """An actor reads its files on its own node: the names it is handed are checked there too."""
    from actors.hf_io import read_safetensors

    directory = _model_dir(tmp_path, {"w": "model-00001-of-00001.safetensors"})
    os.mkfifo(os.path.join(directory, "fifo.safetensors"))
    stage = torch.nn.Linear(2, 2, bias=False)
    with pytest.raises(ValueError, match=r"the weight map of .*: 'w' is '\.\./x.safetensors', not a plain file name"):
        read_safetensors(directory, {0: stage}, {0: {"weight": "w"}}, {"w": "../x.safetensors"})
    with _fails_if_blocked(), pytest.raises(ValueError, match=r"fifo.safetensors is a FIFO, not a regular file"):
        read_safetensors(directory, {0: stage}, {0: {"weight": "w"}}, {"w": "fifo.safetensors"})
    read_safetensors(directory, {0: stage}, {0: {"weight": "w"}}, {"w": "model-00001-of-00001.safetensors"})
    assert torch.equal(stage.weight.detach(), torch.ones(2, 2))


# -- prepare-data's stale temporary directories ------------------------------------------------------
def test_stale_temporary_directories_of_the_output_are_swept(ray_session, tmp_path):
    """Note [stale prepare directories]: a tmp directory of the same output whose writer died on
    this machine, or one unchanged for a day, is removed at the next run; a fresh one, one a
    live process writes, and anything not of this output's pattern stay."""
    (tmp_path / "a.txt").write_text("".join(f"paragraph {i} " * (i % 5 + 1) + "\n\n" for i in range(30)))
    tok = train_tokenizer([f"paragraph {i}" for i in range(30)] * 3, TokenizerConfig(vocab_size=280, min_frequency=1))
    cfg = DataConfig(train_files=(str(tmp_path / "a.txt"),), workers=1, prepared_dir=str(tmp_path / "prep"))
    tokens = prepare_data(cfg, str(tmp_path / "run"), tok.to_str(), log=lambda *a: None)
    parent, base = os.path.split(tokens.directory)
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    live = os.path.basename(temporary_path(tokens.directory))  # .BASE.tmp-MACHINE-PID-RANDOM, this process's
    machine = live.split(".tmp-")[1].split("-")[0]
    day_ago = os.stat(tokens.directory).st_mtime - 2 * 24 * 3600
    names = {
        "old": f".{base}.tmp-0badf00d",  # an older mpmd's naming, unchanged for two days
        "dead": f".{base}.tmp-{machine}-{dead.pid}-12345678",  # its writer gone, here
        "live": live,  # this process writes it
        "other machine": f".{base}.tmp-00000000-{dead.pid}-12345678",  # fresh, from another machine
        "fresh": f".{base}.tmp-abcdef01",
        "not ours": f".{base}x.tmp-0badf00d",
        "another output": ".0123456789abcdef.tmp-0badf00d",
    }
    for what, name in names.items():
        os.makedirs(os.path.join(parent, name))
        with open(os.path.join(parent, name, "shard-000000.bin"), "wb") as f:
            f.write(b"\0" * 8)
        if what in ("old", "not ours", "another output"):
            for path in (os.path.join(parent, name, "shard-000000.bin"), os.path.join(parent, name)):
                os.utime(path, (day_ago, day_ago))
    logs = []
    assert prepare_data(cfg, str(tmp_path / "run"), tok.to_str(), log=logs.append).directory == tokens.directory
    left = set(os.listdir(parent))
    assert {names["old"], names["dead"]}.isdisjoint(left)
    assert {names[w] for w in ("live", "other machine", "fresh", "not ours", "another output")} <= left
    assert f"removed 2 temporary directories of {tokens.directory} that no live process writes" in logs[0]


# -- mpmd export on a machine without the training data ----------------------------------------------
@pytest.fixture(scope="module")
def trained_run(ray_session, tmp_path_factory):
    """A run directory as ``mpmd train`` leaves it (config.toml, tokenizer, a step-N checkpoint
    of a pipeline of the config's model), whose config names training files, a tokenizer path
    and an init_from directory that this machine lacks; and the pipeline's state."""
    import mpmd
    from mpmd.lm import load_config, to_toml
    from mpmd.lm.models import llama_spec, stage_factories
    from mpmd.planning import causal_lm_loss

    from tests.models import sgd

    run = tmp_path_factory.mktemp("run")
    with open(builtin_path("builtin:debug")) as f:
        docs = [d for d in f.read(20_000).split("\n\n") if d.strip()]
    tok = train_tokenizer(docs, TokenizerConfig(vocab_size=300, min_frequency=1))
    save_tokenizer(tok, str(run / "tokenizer"))
    cfg = load_config("configs/debug.toml", ["tokenizer.vocab_size=300", "data.seq_len=32"])
    text = to_toml(cfg).replace('train_files = ["builtin:debug"]', 'train_files = ["/nowhere/corpus-*.txt"]')
    text = text.replace("# path = (unset)", 'path = "/nowhere/tokenizer.json"', 1)
    text = text.replace("# init_from = (unset)", 'init_from = "/nowhere/hf"', 1)
    assert "/nowhere/corpus" in text and "/nowhere/tokenizer.json" in text and "/nowhere/hf" in text
    (run / "config.toml").write_text(text)
    spec = llama_spec(cfg.model, tok.get_vocab_size())
    with mpmd.Pipeline(stage_factories(spec, 2, 32), schedule="1f1b", num_microbatches=2, loss_fn=causal_lm_loss,
                       optimizer=sgd, device="cpu", num_cpus=0.25) as pipe:
        pipe.save(str(run / "checkpoints" / "step-1"))
        state = pipe.state_dict()
    return run, state


def test_mpmd_export_needs_none_of_the_training_machines_files(trained_run, tmp_path, capsys):
    """The run's config names data, a tokenizer and a starting model this machine lacks: the
    export reads only the config's [model] and writes a model transformers loads."""
    import transformers

    from mpmd.cli import main

    run, state = trained_run
    assert main(["export", str(run / "checkpoints"), "--hf", str(tmp_path / "hf")]) == 0
    assert "transformers' from_pretrained loads it" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    got = model.state_dict()
    for key, value in state.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=0)


def test_mpmd_export_checks_before_it_writes(trained_run, tmp_path, capsys):
    """A bad [model] section, a dtype torch lacks, a stage file missing: an error line and exit
    code 2, and nothing written."""
    import shutil

    from mpmd.cli import main

    run, _ = trained_run
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    text = (bad / "config.toml").read_text()
    (bad / "config.toml").write_text(text.replace('size = "debug"', 'size = "huge"', 1))
    assert main(["export", str(bad / "checkpoints"), "--hf", str(tmp_path / "a")]) == 2
    assert "model.size = 'huge' is not one of" in capsys.readouterr().err
    (bad / "config.toml").write_text(text)
    assert main(["export", str(bad / "checkpoints"), "--hf", str(tmp_path / "b"), "--dtype", "load"]) == 2
    assert "dtype 'load' is not a torch dtype; give e.g. 'bfloat16'" in capsys.readouterr().err
    os.remove(bad / "checkpoints" / "step-1" / "stage-0001.pt")
    assert main(["export", str(bad / "checkpoints"), "--hf", str(tmp_path / "c")]) == 2
    assert "lacks stage-0001.pt (stage 1 of 2); the checkpoint is incomplete" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abc")
