"""File names read from files, checked before anything is opened (Note [names from files]).

Note [names from files]
~~~~~~~~~~~~~~~~~~~~~~~
Some files name other files: a prepared directory's ``index.json`` its shards
(mpmd/lm/tokens.py), a Hugging Face ``model.safetensors.index.json`` its weight files
(mpmd/training/export.py, actors/hf_io.py).  Such a name is joined to the directory only when
it is a plain name of it (``plain_name``: no path separator, not ``.`` or ``..``, not absolute,
the suffix the writer gives), so an edited or crafted index reads nothing outside the
directory; and a file is opened only when it is a regular file (``regular_stat`` before a
library opens the path, ``open_regular`` where we open it), so a FIFO, a device or a socket
under an expected name is an error, not a read that blocks an actor forever or never ends.
``open_regular`` opens without blocking and checks what it opened (``fstat``), so the file
checked is the file read; where a library takes only a path (safetensors' ``safe_open``) the
check is a ``stat`` just before, which is enough against a wrong file, not against another
process swapping it in between (that process could as well write the file itself)."""

from __future__ import annotations

import os
import stat
from typing import IO, Any, Optional

__all__ = ["plain_name", "regular_stat", "open_regular"]

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def plain_name(name: Any, suffix: str, *, where: str, fix: str) -> str:
    """``name`` when it is a plain file name ending in ``suffix`` (Note [names from files]),
    else a ValueError saying ``where`` it was read and how to ``fix`` it."""
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if (not isinstance(name, str) or name in ("", ".", "..") or os.path.isabs(name) or "\0" in name
            or any(s in name for s in seps) or not name.endswith(suffix)):
        raise ValueError(f"{where} is {name!r}, not a plain file name ending in {suffix} (one of the directory's "
                         f"own files: no path separator, not '.' or '..', not absolute); {fix}")
    return name


def _not_regular(path: str, mode: int, where: str, fix: str) -> ValueError:
    kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
    return ValueError(f"{where}: {path} is {kind}, not a regular file; {fix}")


def regular_stat(path: str, *, where: str, fix: str) -> Optional[os.stat_result]:
    """``os.stat`` of ``path`` (a link followed), None when nothing is there, a ValueError when
    it is not a regular file (a FIFO, a device, a directory, a socket)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        raise _not_regular(path, st.st_mode, where, fix)
    return st


def open_regular(path: str, mode: str = "rb", *, where: str, fix: str) -> IO:
    """``path`` opened for reading (``mode`` "r" or "rb") when it is a regular file, else a
    ValueError; FileNotFoundError when nothing is there.  Opened with ``O_NONBLOCK``, so a FIFO
    is refused at once rather than waited on for a writer."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular reads: mode 'r' or 'rb', not {mode!r}")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _not_regular(path, st.st_mode, where, fix)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise
