"""The training files as units of work and the documents in each (Note [prepared data] in
``prepare.py``): byte ranges of text and jsonl files, row groups of parquet files; every
bad input is a ValueError naming the file and the fix."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator

from .config import DataConfig
from .data import builtin_path, file_format

__all__ = ["Unit", "plan_units", "documents", "corpus_paths"]


@dataclasses.dataclass(frozen=True)
class Unit:
    """A piece of one training file: bytes ``[start, end)`` (text, jsonl) or row groups (parquet)."""

    index: int
    path: str
    fmt: str
    start: int
    end: int
    size: int  # bytes, for the tokenizer's sample


def corpus_paths(cfg: DataConfig) -> list[str]:
    return [builtin_path(e) if e.startswith("builtin:") else os.path.abspath(e) for e in cfg.files()]


def plan_units(cfg: DataConfig) -> list[Unit]:
    """The training files cut into units (Note [prepared data]); a file that is empty, has an
    unknown format or lacks ``text_key`` is a ValueError naming it."""
    import pyarrow.parquet as pq

    chunk = max(1, int(cfg.chunk_mb * 2 ** 20))
    units: list[Unit] = []
    for path in corpus_paths(cfg):
        fmt = file_format(path, cfg.format)
        size = os.path.getsize(path)
        if size == 0:
            raise ValueError(f"data.train_files: {path} is empty; remove it from data.train_files (or its glob)")
        if fmt == "parquet":
            meta = pq.ParquetFile(path).metadata
            names = meta.schema.names
            if cfg.text_key not in names:
                raise ValueError(f"{path} has no column {cfg.text_key!r} (its columns: {names}); set data.text_key")
            for g in range(meta.num_row_groups):
                units.append(Unit(len(units), path, fmt, g, g + 1, meta.row_group(g).total_byte_size))
            continue
        if fmt == "jsonl":
            _check_first_line(path, cfg.text_key)
        for a in range(0, size, chunk):
            units.append(Unit(len(units), path, fmt, a, min(a + chunk, size), min(a + chunk, size) - a))
    return units


def _check_first_line(path: str, key: str) -> None:
    with open(path, "rb") as f:
        for pos, raw in _lines(f):
            if raw.strip():
                row = _json_row(raw, path, pos)
                if key not in row:
                    raise ValueError(f"{path} has no column {key!r} (its columns: {sorted(row)}); set data.text_key")
                return


def _decode(raw: bytes, path: str, pos: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: byte {pos + e.start} is not UTF-8 ({e.reason}); the training files must be "
                         f"UTF-8 text (convert it, e.g. `iconv -f latin1 -t utf-8`)") from None


def _json_row(raw: bytes, path: str, pos: int) -> dict:
    try:
        row = json.loads(_decode(raw, path, pos))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: the line at byte {pos} is not JSON ({e.msg}); a .jsonl file holds one JSON "
                         f"object per line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}: the line at byte {pos} is a JSON {type(row).__name__}, not an object")
    return row


def _lines(f) -> Iterator[tuple[int, bytes]]:
    while True:
        pos = f.tell()
        raw = f.readline()
        if not raw:
            return
        yield pos, raw


def _line_before(f, pos: int) -> bytes:
    """The line that ends with the newline at ``pos - 1`` (``f`` left at ``pos``)."""
    start, block = pos - 1, 4096
    while start > 0:
        lo = max(0, start - block)
        f.seek(lo)
        found = f.read(start - lo).rfind(b"\n")
        if found >= 0:
            start = lo + found + 1
            break
        start = lo
    f.seek(start)
    line = f.read(pos - 1 - start)
    f.seek(pos)
    return line


def _first_line_at(f, start: int) -> int:
    """The position of the first line that starts at or after ``start``."""
    if start > 0:
        f.seek(start - 1)
        f.readline()
    return f.tell()


def documents(unit: Unit, text_key: str) -> Iterator[str]:
    """The unit's documents in order, empty ones left out (Note [prepared data])."""
    if unit.fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(unit.path).read_row_groups(list(range(unit.start, unit.end)), columns=[text_key])
        for value in table.column(0).to_pylist():
            if value is not None and str(value).strip():
                yield str(value)
        return
    with open(unit.path, "rb") as f:
        pos = _first_line_at(f, unit.start)
        if unit.fmt == "jsonl":
            for pos, raw in _lines(f):
                if pos >= unit.end:
                    return
                if raw.strip():
                    row = _json_row(raw, unit.path, pos)
                    if text_key not in row:
                        raise ValueError(f"{unit.path}: the line at byte {pos} has no column {text_key!r} (its "
                                         f"columns: {sorted(row)}); set data.text_key")
                    if str(row[text_key]).strip():
                        yield str(row[text_key])
            return
        # text: skip the paragraph begun before the unit, finish the one begun in it
        skipping = pos > 0 and bool(_decode(_line_before(f, pos), unit.path, pos).strip())
        current: list[str] = []
        for pos, raw in _lines(f):
            if pos >= unit.end and not current:
                return
            line = _decode(raw, unit.path, pos)
            line = line[:-1] if line.endswith("\n") else line
            line = line[:-1] if line.endswith("\r") else line
            if not line.strip():
                if current:
                    yield "\n".join(current)
                current, skipping = [], False
            elif not skipping:
                current.append(line)
        if current:
            yield "\n".join(current)
