"""``mpmd prepare-data CONFIG``: the corpus tokenized once, in parallel, into token files
every actor memory-maps (``mpmd train`` runs it when the files are missing).

Note [prepared data]
The training files are cut into units of work: byte ranges of about ``data.chunk_mb`` of
a text or jsonl file, and row groups of a parquet file.  A Ray Data pipeline
(``from_items(units).map_batches(_tokenize_units)`` on ``data.workers`` tasks at a time)
tokenizes the units in parallel; each task writes its unit's tokens (each document's, then
EOS, with the ``tokenizer.json`` kept in the directory) to ``shard-NNNNNN.bin`` (uint16 when the vocabulary fits, else uint32) and the
documents' end offsets to ``shard-NNNNNN.idx`` (int64), and returns only counts.  The
controller writes ``index.json`` (the shards in corpus order, their counts, the corpus
and the tokenizer they came from) and renames the directory into place, so a directory
is either whole or absent: a failure leaves no half of one behind.  No process holds more
than a unit's text and tokens, the controller none of them.

Documents: a jsonl line's or a parquet row's ``data.text_key``; a text file's
paragraphs (lines split at "\\n", one trailing "\\r" dropped; blank lines separate
paragraphs, and the lines of one are joined with "\\n").  A byte range owns the lines that
start in it, and the paragraphs whose first line starts in it: its worker reads past the
range's end to finish its last paragraph and skips the one begun before its start, so
units give exactly the documents the whole file would.

The directory is ``data.prepared_dir`` (default ``RUN_DIR/prepared``) / a key of the
corpus (each file's path, size and modification time, the format and text key) and of
the tokenizer's JSON: a rerun or a resume finds it and reuses it; changing either makes
another.  Across nodes ``data.prepared_dir`` must be a filesystem every node mounts: the
workers write there, and a shard the controller cannot see is an error naming it.

The tokenizer, when the run trains one, is trained in a Ray task on a sample of at most
``tokenizer.sample_mb`` of documents taken evenly over the units (each unit's first
documents in proportion to its size; the whole corpus when it is smaller).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import socket
import stat
import time
import uuid
from typing import Callable, Optional

import numpy as np

from .config import DataConfig, TokenizerConfig
from .corpus import Unit, corpus_paths, documents, plan_units
from .data import eos_id, load_tokenizer, save_tokenizer, train_tokenizer
from .tokens import INDEX, TOKEN_DTYPES, PreparedTokens

__all__ = ["prepare_data", "prepare_tokenizer", "train_tokenizer_on_sample", "temporary_path"]

_VERSION = 1
TOKENIZER = "tokenizer.json"  # the tokenizer that made a prepared directory, kept in it
_ENCODE_BATCH = 256  # documents per encode_batch call


def _sample(units: list[Unit], text_key: str, budget: int) -> list[str]:
    total = sum(u.size for u in units)
    docs: list[str] = []
    for u in units:
        share, taken = (u.size if total <= budget else budget * u.size / total), 0
        for d in documents(u, text_key):
            if taken >= share:
                break
            docs.append(d)
            taken += len(d.encode())
    return docs


def _train_on_sample(units: list[Unit], data: DataConfig, cfg: TokenizerConfig) -> tuple[str, int]:
    docs = _sample(units, data.text_key, int(cfg.sample_mb * 2 ** 20))
    if not docs:
        raise ValueError(f"data.train_files {list(data.train_files)} hold no text")
    return train_tokenizer(docs, cfg).to_str(), len(docs)


def train_tokenizer_on_sample(units: list[Unit], data: DataConfig, cfg: TokenizerConfig) -> tuple[str, int]:
    """A byte-level BPE trained on a sample of the units, in a Ray task (Note [prepared data]):
    (its JSON, the documents it saw)."""
    import ray

    task = ray.remote(num_cpus=1, max_calls=1)(_train_on_sample)
    try:
        return ray.get(task.remote(units, data, cfg))
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, ValueError):
            raise e.cause from None
        raise


def prepare_tokenizer(units: list, data: DataConfig, cfg: TokenizerConfig, run_dir: str, log=print):
    """The user's tokenizer, the run's saved one (resume), or a new BPE trained on a sample of
    the training files' ``units`` (``prepare.py``) and saved."""
    if cfg.path is not None:
        return load_tokenizer(cfg.path)
    saved = os.path.join(run_dir, "tokenizer", "tokenizer.json")
    if os.path.isfile(saved):
        log(f"tokenizer: {saved} (the run's)")
        return load_tokenizer(saved)
    from tokenizers import Tokenizer

    text, seen = train_tokenizer_on_sample(units, data, cfg)
    tok = Tokenizer.from_str(text)
    save_tokenizer(tok, os.path.dirname(saved))
    log(f"tokenizer: byte-level BPE of {tok.get_vocab_size()} tokens trained on {seen} documents, saved to {saved}")
    return tok


def _tokenize_units(batch: dict, *, directory: str, text_key: str, dtype: str) -> dict:
    """A Ray Data task: tokenize units and write their shards (Note [prepared data]); only
    counts come back, and bad input comes back as its message for the controller to raise."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per task: data.workers says how many
    from tokenizers import Tokenizer

    start_rss = _status_bytes("VmRSS")
    tok = Tokenizer.from_file(os.path.join(directory, TOKENIZER))
    out: dict[str, list] = {"index": [], "tokens": [], "documents": [], "error": [], "peak_rss": [], "start_rss": []}
    for i in range(len(batch["index"])):
        unit = Unit(**{f.name: _plain(batch[f.name][i]) for f in dataclasses.fields(Unit)})
        try:
            tokens, docs, error = *_write_unit(unit, tok, directory, text_key, np.dtype(dtype)), ""
        except ValueError as e:
            tokens, docs, error = 0, 0, str(e)
        for key, value in (("index", unit.index), ("tokens", tokens), ("documents", docs), ("error", error),
                           ("peak_rss", _status_bytes("VmHWM")), ("start_rss", start_rss)):
            out[key].append(value)
    return out


def _status_bytes(field: str) -> int:
    """A size from /proc/self/status (``VmRSS``, ``VmHWM``: the kernel's peak), 0 off Linux."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _plain(value):
    return value.item() if isinstance(value, np.generic) else value


def _write_unit(unit: Unit, tok, directory: str, text_key: str, dtype: np.dtype) -> tuple[int, int]:
    """``shard-NNNNNN.bin``: the unit's tokens, EOS after each document; ``.idx``: the documents'
    end offsets in it (int64); returns (tokens, documents)."""
    eos, name = eos_id(tok), os.path.join(directory, f"shard-{unit.index:06d}")
    tokens = docs = 0
    with open(name + ".bin", "wb") as bin_f, open(name + ".idx", "wb") as idx_f:
        group: list[str] = []
        for doc in itertools.chain(documents(unit, text_key), [None]):
            if doc is not None:
                group.append(doc)
            if group and (doc is None or len(group) == _ENCODE_BATCH):
                ids = [np.asarray(e.ids + [eos], dtype=dtype) for e in tok.encode_batch(group, add_special_tokens=False)]
                bin_f.write(np.concatenate(ids).tobytes())
                idx_f.write((tokens + np.cumsum([len(x) for x in ids], dtype=np.int64)).tobytes())
                tokens, docs, group = tokens + sum(len(x) for x in ids), docs + len(ids), []
    return tokens, docs


def _key(paths: list[str], cfg: DataConfig, tokenizer_json: str) -> dict:
    files = [[p, st.st_size, st.st_mtime_ns] for p in paths for st in (os.stat(p),)]
    return {"version": _VERSION, "files": files, "format": cfg.format, "text_key": cfg.text_key,
            "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode()).hexdigest()}


def _directory(cfg: DataConfig, run_dir: str, key: dict) -> str:
    """Where the corpus and tokenizer of ``key`` are (or will be) prepared."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cfg.prepared_dir or os.path.join(run_dir, "prepared"), digest)


def prepare_data(cfg: DataConfig, run_dir: str, tokenizer_json: str, *, log: Callable[[str], None] = print,
                 units: Optional[list[Unit]] = None) -> PreparedTokens:
    """The prepared tokens of the training files: found, or made now (Note [prepared data])."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    key = _key(corpus_paths(cfg), cfg, tokenizer_json)
    final = _directory(cfg, run_dir, key)
    swept = _sweep_stale(final)
    if swept:
        log(f"data: removed {len(swept)} temporary directories of {final} that no live process writes: "
            f"{', '.join(swept)}")
    if os.path.isdir(final):
        tokens = PreparedTokens(final)
        _check_same(tokens, key, tok)
        tokens.check()
        log(f"data: {final} ({tokens.tokens} tokens of {tokens.index['documents']} documents, prepared before)")
        return tokens
    units = plan_units(cfg) if units is None else units
    os.makedirs(os.path.dirname(final), exist_ok=True)
    tmp = temporary_path(final)
    os.makedirs(tmp)
    try:
        dtype = TOKEN_DTYPES[0] if tok.get_vocab_size() <= 2 ** 16 else TOKEN_DTYPES[1]  # uint16, else uint32
        results, stats = _run_units(units, cfg, tokenizer_json, tmp, dtype, log)
        shards = []
        for u in units:
            count, docs = results[u.index]
            shard = {"file": f"shard-{u.index:06d}.bin", "docs": f"shard-{u.index:06d}.idx", "tokens": count,
                     "documents": docs, "source": [u.path, u.start, u.end]}
            for name, size in ((shard["file"], count * np.dtype(dtype).itemsize), (shard["docs"], docs * 8)):
                path = os.path.join(tmp, name)
                if not os.path.isfile(path) or os.path.getsize(path) != size:
                    raise RuntimeError(f"a tokenizing worker wrote {name} where {socket.gethostname()} does not see "
                                       f"it whole ({path}): on a cluster, data.prepared_dir "
                                       f"({os.path.dirname(final)}) must be a filesystem every node mounts")
            shards.append(shard)
        total, docs = sum(s["tokens"] for s in shards), sum(s["documents"] for s in shards)
        if docs == 0:
            raise ValueError(f"data.train_files {list(cfg.train_files)} hold no text")
        index = {**key, "dtype": dtype, "vocab_size": tok.get_vocab_size(), "eos_id": eos_id(tok),
                 "tokens": total, "documents": docs, "prepared": stats, "shards": shards}
        with open(os.path.join(tmp, INDEX), "w") as f:
            json.dump(index, f, indent=1)
        try:
            os.rename(tmp, final)
        except OSError:  # another process prepared it meanwhile: keep theirs
            if not os.path.isfile(os.path.join(final, INDEX)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"data: prepared {total} tokens of {docs} documents from {len({u.path for u in units})} files into {final} "
        f"({total / max(stats['seconds'], 1e-9):,.0f} tokens/s on {stats['workers']} workers)")
    return PreparedTokens(final)


# Note [stale prepare directories]
# ``prepare_data`` fills ``.DIGEST.tmp-MACHINE-PID-RANDOM`` beside its output and renames it into
# place; an error removes it, but a killed process (SIGKILL, out of memory, a lost node) leaves
# it.  The next run of the same output removes such a sibling when it is clearly ours (the
# name's pattern, a real directory, not a link) and clearly dead:
# * MACHINE is this one's (a hash of the host name, the kernel's boot and the PID namespace:
#   two hosts, or two containers, of one host name differ) and no process has PID: the writer
#   died here (a PID taken again by another process keeps the directory: the next rule); or
# * nothing in it (the directory, its files) changed for _STALE_SECONDS.  A live prepare
#   changes it all the time (the workers create a shard per unit and append every
#   _ENCODE_BATCH documents), so a day without a change is a writer that is gone, on any node;
#   a tmp directory of the old naming (no MACHINE-PID) is judged by this alone.
# A directory swept from under a writer that was alive after all makes that writer fail (its
# shard or its rename is missing), never a wrong prepared directory.  prepare-data replaces
# nothing (``os.rename`` onto a missing path), so it leaves no ``.old`` directories.
_STALE_SECONDS = 24 * 3600


def _machine() -> str:
    """This machine's boot and this PID namespace, as 8 hex digits (Note [stale prepare
    directories]): the host name, the kernel's boot id (hosts of one name differ) and the PID
    namespace's inode (containers of one kernel differ)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = 0
    return hashlib.sha256(f"{socket.gethostname()}\0{boot}\0{namespace}".encode()).hexdigest()[:8]


def temporary_path(final: str) -> str:
    """A new temporary sibling of ``final`` for this process to fill, ``.NAME.tmp-MACHINE-PID-RANDOM``
    (Note [stale prepare directories])."""
    parent, base = os.path.split(final)
    return os.path.join(parent, f".{base}.tmp-{_machine()}-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; a PID no process can have
        return True
    return True


def _last_change(path: str) -> float:
    """The newest modification time of the directory ``path`` and its entries."""
    newest = os.lstat(path).st_mtime
    with os.scandir(path) as entries:
        for entry in entries:
            newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    return newest


def _sweep_stale(final: str) -> list[str]:
    """Remove the temporary directories of ``final`` that no live process writes (Note [stale
    prepare directories]); the names removed."""
    parent, base = os.path.split(final)
    ours = re.compile(rf"\.{re.escape(base)}\.tmp-(?:([0-9a-f]{{8}})-(\d+)-)?[0-9a-f]{{8}}")
    try:
        names = sorted(os.listdir(parent))
    except FileNotFoundError:
        return []
    machine, now, swept = _machine(), time.time(), []
    for name in names:
        m = ours.fullmatch(name)
        path = os.path.join(parent, name)
        try:
            if not m or not stat.S_ISDIR(os.lstat(path).st_mode):
                continue
            dead = m.group(1) == machine and not _pid_alive(int(m.group(2)))
            if dead or now - _last_change(path) > _STALE_SECONDS:
                shutil.rmtree(path)
                swept.append(name)
        except OSError:  # swept by another run meanwhile, or not ours to remove: no reason to stop this run
            continue
    return swept


def _check_same(tokens: PreparedTokens, key: dict, tok) -> None:
    index = tokens.index
    if index.get("version") != _VERSION:
        raise ValueError(f"prepared data {tokens.directory} has format version {index.get('version')}, this mpmd "
                         f"writes {_VERSION}: delete the directory and run `mpmd prepare-data CONFIG` again")
    if index.get("tokenizer_sha256") != key["tokenizer_sha256"] or index.get("vocab_size") != tok.get_vocab_size():
        raise ValueError(f"prepared data {tokens.directory} was made with another tokenizer (vocabulary "
                         f"{index.get('vocab_size')}, this run's {tok.get_vocab_size()}): delete it, or point "
                         f"data.prepared_dir elsewhere, and run `mpmd prepare-data CONFIG` again")


def _run_units(units: list[Unit], cfg: DataConfig, tokenizer_json: str, directory: str, dtype: str,
               log: Callable[[str], None]) -> tuple[dict, dict]:
    """Tokenize every unit on ``data.workers`` Ray Data tasks at a time: {unit: (tokens, documents)},
    and how it went (seconds, workers, the tasks' peak RSS and their RSS when they began)."""
    import ray
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset INFO lines
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    workers = cfg.workers or max(1, min(8, int(ray.cluster_resources().get("CPU", 1))))
    rows = [dataclasses.asdict(u) for u in units]
    ds = ray.data.from_items(rows, override_num_blocks=len(rows))
    with open(os.path.join(directory, TOKENIZER), "w") as f:  # the workers read it; it stays with the tokens
        f.write(tokenizer_json)
    out = ds.map_batches(_tokenize_units, fn_kwargs=dict(directory=directory, text_key=cfg.text_key, dtype=dtype),
                         batch_size=1, compute=ray.data.TaskPoolStrategy(size=min(workers, len(units))), num_cpus=1)
    results: dict[int, tuple[int, int]] = {}
    t0, told, peak, start = time.perf_counter(), 0, 0, None
    for row in out.iter_rows():
        if row["error"]:
            raise ValueError(row["error"])
        results[int(row["index"])] = (int(row["tokens"]), int(row["documents"]))
        peak = max(peak, int(row["peak_rss"]))
        start = int(row["start_rss"]) if start is None else min(start, int(row["start_rss"]))
        if len(units) >= 10 and len(results) * 10 // len(units) > told:
            told = len(results) * 10 // len(units)
            done = sum(t for t, _ in results.values())
            log(f"data: {len(results)}/{len(units)} units, {done} tokens, "
                f"{done / (time.perf_counter() - t0):,.0f} tokens/s on {workers} workers")
    stats = {"seconds": time.perf_counter() - t0, "workers": workers, "task_peak_rss_bytes": peak,
             "task_start_rss_bytes": start or 0}
    return results, stats
