"""The tokenizer of ``mpmd train``, with no downloads, and the training files' formats.

The tokenizer is the ``tokenizer.json`` the user gives, or a byte-level BPE trained with
the ``tokenizers`` library on a sample of the training files (``prepare.py``) and saved
in the run directory (a resume reuses it).  The corpus itself is tokenized once into
prepared token files (``prepare.py``) that the actors read by step (``tokens.py``)."""

from __future__ import annotations

import importlib.resources
import os
from typing import Sequence

from .config import TokenizerConfig

__all__ = ["EOS", "train_tokenizer", "load_tokenizer", "save_tokenizer", "eos_id", "builtin_path",
           "file_format"]

EOS = "<|endoftext|>"
_BUILTIN = {"builtin:debug": "data/corpus.txt"}


def builtin_path(name: str) -> str:
    """The file of a ``builtin:`` data name (text the package ships)."""
    if name not in _BUILTIN:
        raise ValueError(f"data.train_files: unknown built-in {name!r}; the package ships {', '.join(_BUILTIN)}")
    return str(importlib.resources.files("mpmd.cli").joinpath(_BUILTIN[name]))


def file_format(path: str, fmt: str) -> str:
    """The format of a training file: ``fmt``, or by its extension when "auto"."""
    if fmt != "auto":
        return fmt
    ext = os.path.splitext(path)[1].lower()
    kinds = {".txt": "text", ".md": "text", ".text": "text", ".jsonl": "jsonl", ".json": "jsonl",
             ".parquet": "parquet"}
    if ext not in kinds:
        raise ValueError(f"data.train_files: cannot tell the format of {path!r} from its extension; use .txt, "
                         f".jsonl or .parquet, or set data.format")
    return kinds[ext]


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


def save_tokenizer(tok, directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "tokenizer.json")
    tok.save(path)
    return path
