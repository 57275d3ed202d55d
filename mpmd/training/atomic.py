"""Atomic checkpoint directories (Note [atomic checkpoint] in ``checkpoint.py``): a temporary
sibling directory that is filled, fsynced and renamed into place, and the readers' fallback
to the previous directory when a crash came between the two renames of an overwrite."""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import uuid
from typing import Any, Callable, Optional

import torch

__all__ = ["begin", "commit", "abort", "write_atomically", "write_tensor_file", "write_json", "fsync_dir",
           "fallback"]


def begin(path: str) -> tuple[str, str]:
    """``(absolute path, new temporary directory next to it)``; leftovers of an earlier save of
    the same name that died are removed first."""
    path = os.path.abspath(os.fspath(path))
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(parent, f".{name}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
    return path, tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)


def commit(tmp: str, path: str) -> str:
    """Make the filled directory ``tmp`` the checkpoint ``path``: fsync it, rename it into place
    (an existing ``path`` goes to ``.NAME.old-*`` first and is removed after), fsync the parent."""
    parent, name = os.path.split(path)
    fsync_dir(tmp)
    if os.path.lexists(path):
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        os.rename(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, path)
    fsync_dir(parent)
    return path


def abort(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def write_atomically(path: str, write: Callable[[str], None]) -> str:
    """``write(tmp)`` fills a temporary directory that then becomes ``path``; on any error the
    temporary directory goes and ``path`` stays as it was."""
    path, tmp = begin(path)
    try:
        write(tmp)
        return commit(tmp, path)
    except BaseException:
        abort(tmp)
        raise


def write_tensor_file(path: str, obj: Any) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory handles
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fallback(path: str, is_complete: Callable[[str], bool]) -> Optional[str]:
    """The checkpoint a crash between the two renames of an overwrite left at ``.NAME.old-*``."""
    parent, name = os.path.split(os.path.abspath(path))
    olds = [p for p in glob.glob(os.path.join(parent, f".{name}.old-*")) if is_complete(p)]
    return max(olds, key=os.path.getmtime) if olds else None
