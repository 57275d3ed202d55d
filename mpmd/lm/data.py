"""Tokenizer and data of ``mpmd train``, with no downloads.

The training files (.txt, .jsonl, .parquet) are read with Ray Data in the order given
(``preserve_order``); a text file's documents are its blank-line-separated paragraphs, a
jsonl or parquet row's ``text_key`` is one document.  The tokenizer is a byte-level BPE
trained on those documents with the ``tokenizers`` library (saved in the run directory and
reused on resume), or the ``tokenizer.json`` the user gives.  Documents are tokenized,
joined with EOS after each, and cut into ``seq_len`` sequences; a seeded permutation holds
out validation sequences, and ``LMData.batch(step)`` is a pure function of the step (an
epoch's order is a permutation seeded by (seed, epoch)), so a resumed run at step N takes
exactly the batches the uninterrupted one took from step N on (Note [data order])."""

from __future__ import annotations

import importlib.resources
import json
import logging
import os
from typing import Optional, Sequence

import numpy as np
import torch

from .config import DataConfig, TokenizerConfig

__all__ = ["EOS", "LMData", "read_documents", "train_tokenizer", "load_tokenizer", "pack", "builtin_path"]

EOS = "<|endoftext|>"
_BUILTIN = {"builtin:debug": "data/corpus.txt"}


def builtin_path(name: str) -> str:
    """The file of a ``builtin:`` data name (text the package ships)."""
    if name not in _BUILTIN:
        raise ValueError(f"data.train_files: unknown built-in {name!r}; the package ships {', '.join(_BUILTIN)}")
    return str(importlib.resources.files("mpmd.cli").joinpath(_BUILTIN[name]))


def _format(path: str, fmt: str) -> str:
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    kinds = {".txt": "text", ".md": "text", ".text": "text", ".jsonl": "jsonl", ".json": "jsonl",
             ".parquet": "parquet"}
    if ext not in kinds:
        raise ValueError(f"data.train_files: cannot tell the format of {path!r} from its extension; use .txt, "
                         f".jsonl or .parquet, or set data.format")
    return kinds[ext]


def read_documents(cfg: DataConfig) -> list[str]:
    """Every document of the training files, in file order (Ray Data, order preserved)."""
    import ray.data

    logging.getLogger("ray.data").setLevel(logging.WARNING)  # its per-dataset INFO lines
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    docs: list[str] = []
    for entry in cfg.files():
        path = builtin_path(entry) if entry.startswith("builtin:") else os.path.abspath(entry)
        fmt = _format(path, cfg.format)
        if fmt == "text":
            lines = [r["text"] for r in ray.data.read_text(path, drop_empty_lines=False).take_all()]
            docs.extend(_paragraphs(lines))
            continue
        ds = ray.data.read_json(path, lines=True) if fmt == "jsonl" else ray.data.read_parquet(path)
        if cfg.text_key not in ds.schema().names:
            raise ValueError(f"{path} has no column {cfg.text_key!r} (its columns: {ds.schema().names}); set "
                             f"data.text_key")
        docs.extend(str(r[cfg.text_key]) for r in ds.select_columns([cfg.text_key]).take_all())
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"data.train_files {list(cfg.train_files)} hold no text")
    return docs


def _paragraphs(lines: Sequence[str]) -> list[str]:
    out, current = [], []
    for line in lines:
        if line.strip():
            current.append(line)
        elif current:
            out.append("\n".join(current))
            current = []
    if current:
        out.append("\n".join(current))
    return out


def train_tokenizer(docs: Sequence[str], cfg: TokenizerConfig):
    """A byte-level BPE of ``cfg.vocab_size`` tokens (EOS included) trained on ``docs``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=cfg.vocab_size, min_frequency=cfg.min_frequency, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer)
    return tok


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    if tok.token_to_id(EOS) is None and tok.token_to_id("</s>") is None:
        raise ValueError(f"{path}: the tokenizer has no end-of-text token ({EOS!r} or '</s>'); documents are "
                         f"joined with one")
    return tok


def eos_id(tok) -> int:
    found = tok.token_to_id(EOS)
    return found if found is not None else tok.token_to_id("</s>")


def pack(docs: Sequence[str], tok, seq_len: int) -> np.ndarray:
    """The documents' tokens, EOS after each, cut into (n, seq_len) (the tail dropped)."""
    eos = eos_id(tok)
    ids: list[int] = []
    for enc in tok.encode_batch(list(docs), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    n = len(ids) // seq_len
    return np.asarray(ids[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


# Note [data order]: batch(step) depends on the step only: epoch = step // per_epoch, and the
# epoch's order is the permutation of the training sequences seeded by (seed, epoch).
class LMData:
    """Packed sequences split into training and validation, batches by step."""

    def __init__(self, sequences: np.ndarray, batch_size: int, val_fraction: float, eval_batches: int,
                 seed: int) -> None:
        n = len(sequences)
        order = np.random.default_rng([seed, 2 ** 31]).permutation(n)
        val = min(eval_batches, max(1, round(val_fraction * n / batch_size))) * batch_size
        if n - val < batch_size:
            raise ValueError(f"the training files give {n} sequences: too few for a validation batch and a "
                             f"training batch of optim.batch_size={batch_size}; add data, or lower "
                             f"optim.batch_size or data.seq_len")
        self.val, self.train = sequences[order[:val]], sequences[order[val:]]
        self.batch_size, self.seed = batch_size, seed
        self.per_epoch = len(self.train) // batch_size

    @property
    def tokens(self) -> int:
        return self.train.size

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        epoch, j = divmod(step, self.per_epoch)
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.train))
        ids = torch.from_numpy(self.train[order[j * self.batch_size:(j + 1) * self.batch_size]])
        return ids, ids

    def val_batches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(torch.from_numpy(self.val[i:i + self.batch_size]),) * 2
                for i in range(0, len(self.val), self.batch_size)]


def save_tokenizer(tok, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path


def prepare_tokenizer(docs: Sequence[str], cfg: TokenizerConfig, run_dir: str, log=print):
    """The user's tokenizer, the run's saved one (resume), or a new BPE trained and saved."""
    if cfg.path is not None:
        return load_tokenizer(cfg.path)
    saved = os.path.join(run_dir, "tokenizer", "tokenizer.json")
    if os.path.isfile(saved):
        log(f"tokenizer: {saved} (the run's)")
        return load_tokenizer(saved)
    tok = train_tokenizer(docs, cfg)
    save_tokenizer(tok, os.path.dirname(saved))
    log(f"tokenizer: byte-level BPE of {tok.get_vocab_size()} tokens trained on {len(docs)} documents, "
        f"saved to {saved}")
    return tok


def tokenizer_summary(tok) -> dict:
    return {"vocab_size": tok.get_vocab_size(), "eos_id": eos_id(tok)}


def write_json(path: str, value: dict) -> None:
    with open(path, "w") as f:
        json.dump(value, f, indent=1)
