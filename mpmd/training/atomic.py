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
           "fallback", "check_replaceable"]

# Note [save replaces only a checkpoint]
# An overwrite removes what was at the path, so the path must hold something a save may
# remove: nothing, an empty directory, or a complete checkpoint (``is_complete``).  Anything
# else (a run directory with logs and configs, ``"."``, a file) is refused before any actor
# writes, and again just before the rename (an asynchronous save commits later, and the path
# may have changed since), and is left as it was.


def check_replaceable(path: str, is_complete: Callable[[str], bool]) -> None:
    """Raise ``FileExistsError`` unless ``path`` is free, an empty directory or a complete
    checkpoint (Note [save replaces only a checkpoint])."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise FileExistsError(f"{path} exists and is not a directory; a checkpoint is saved only where nothing is, "
                              f"into an empty directory, or over an earlier checkpoint: choose another path")
    if is_complete(path):
        return
    entries = sorted(os.listdir(path))
    if entries:
        shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
        raise FileExistsError(f"{path} is a directory that is not a checkpoint (it holds {shown}); saving there "
                              f"would delete it, so nothing was written: choose a new path (e.g. {path}/ckpt) or "
                              f"remove the directory yourself")


def begin(path: str, is_complete: Callable[[str], bool]) -> tuple[str, str]:
    """``(absolute path, new temporary directory next to it)`` once ``path`` may be replaced
    (Note [save replaces only a checkpoint]); leftovers of an earlier save of the same name that
    died are removed first."""
    path = os.path.abspath(os.fspath(path))
    check_replaceable(path, is_complete)
    parent, name = os.path.split(path)
    os.makedirs(parent, exist_ok=True)
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
    return path, tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent)


def commit(tmp: str, path: str, is_complete: Callable[[str], bool]) -> str:
    """Make the filled directory ``tmp`` the checkpoint ``path``: fsync it, rename it into place
    (an existing ``path``, checked again, goes to ``.NAME.old-*`` first and is removed after,
    with any such copy an earlier crash left), fsync the parent."""
    parent, name = os.path.split(path)
    fsync_dir(tmp)
    check_replaceable(path, is_complete)
    if os.path.lexists(path):
        old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(path, old)
        os.rename(tmp, path)
    else:
        os.rename(tmp, path)
    fsync_dir(parent)
    for stale in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*")):
        shutil.rmtree(stale, ignore_errors=True)  # superseded: the new checkpoint is in place
    return path


def abort(tmp: str) -> None:
    shutil.rmtree(tmp, ignore_errors=True)


def write_atomically(path: str, write: Callable[[str], None], is_complete: Callable[[str], bool]) -> str:
    """``write(tmp)`` fills a temporary directory that then becomes ``path``; on any error the
    temporary directory goes and ``path`` stays as it was."""
    path, tmp = begin(path, is_complete)
    try:
        write(tmp)
        return commit(tmp, path, is_complete)
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
    olds = [p for p in glob.glob(os.path.join(glob.escape(parent), f".{glob.escape(name)}.old-*")) if is_complete(p)]
    return max(olds, key=os.path.getmtime) if olds else None
