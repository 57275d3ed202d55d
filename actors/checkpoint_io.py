"""One actor's shard of a checkpoint: the files of its stages and of its RNG state, written
into the checkpoint's temporary directory by the actor itself and read back by the actors
that own those stages (the format and the protocol: Note [sharded checkpoint] in
``mpmd/training/checkpoint.py``).

Nothing here raises to the controller: a failed write or read becomes the text of the
``ShardReport``, so a full disk fails the save, not the pipeline.  An asynchronous write runs
in a ``ShardWriter`` thread, without the worker's lock, and ends by leaving a marker file
(``.done-NNNN`` or ``.failed-NNNN`` holding the error) that the controller watches for.
"""

from __future__ import annotations

import os
import threading
import traceback
from typing import Any, NamedTuple, Optional

import torch

from .pieces import mark_mapped, merge_parts, shape_of

__all__ = ["ShardReport", "ShardWriter", "Where", "stage_file", "part_file", "part_ranks", "optimizer_shard_file", "rng_file", "done_marker", "failed_marker",
           "is_marker", "leave_marker", "copy_state", "shapes_of", "describe", "write_shard", "read_shard", "load_parts",
           "WRITING", "DONE", "FAILED"]

WRITING, DONE, FAILED = "writing", "done", "failed"


def stage_file(stage: int) -> str:
    return f"stage-{stage:04d}.pt"


def optimizer_shard_file(stage: int, shard: int) -> str:
    """Shard ``shard`` of stage ``stage``'s optimizer state under ZeRO-1, by parameter name: the
    shard of the actor at that index among the rank's ``dp x cp`` actors (its replica at cp=1)."""
    return f"optim-{stage:04d}-{shard:04d}.pt"


def part_file(name: str, tp_rank: int, ep_rank: int = 0) -> str:
    """TP rank ``tp_rank``'s (and EP rank ``ep_rank``'s) part of the file ``name``: ``stage-0003.tp-0001.pt``,
    ``stage-0003.ep-0001.pt`` (Note [checkpoint pieces] in actors/pieces.py, Note [expert pieces] in
    actors/expert_state.py)."""
    stem = name[:-len(".pt")]
    stem += f".tp-{tp_rank:04d}" if tp_rank else ""
    stem += f".ep-{ep_rank:04d}" if ep_rank else ""
    return f"{stem}.pt"


def part_ranks(tp_parts: int, ep_parts: int) -> list[tuple[int, int]]:
    """``(tp rank, ep rank)`` of every part file beside a stage's own file."""
    return [(t, e) for e in range(ep_parts) for t in range(tp_parts) if t or e]


def rng_file(actor: int) -> str:
    return f"rng-{actor:04d}.pt"


def done_marker(actor: int) -> str:
    return f".done-{actor:04d}"


def failed_marker(actor: int) -> str:
    return f".failed-{actor:04d}"


def is_marker(name: str) -> bool:
    """Marker files (and a failed marker being written) are removed before the rename."""
    return name.startswith((".done-", ".failed-"))


class Where(NamedTuple):
    """Which actor a shard belongs to: its index (replica-major, as the controller's list), rank,
    replica, and its index among the rank's ``dp x cp`` actors, which names its ZeRO-1 optimizer
    shard (None: its replica, as at cp=1; Note [resharding] in mpmd/training/checkpoint.py)."""

    index: int
    rank: int
    replica: int
    zero_shard: Optional[int] = None

    @property
    def optimizer_shard(self) -> int:
        return self.replica if self.zero_shard is None else self.zero_shard

    def __str__(self) -> str:
        return f"actor {self.index} (rank {self.rank}, replica {self.replica})"


class ShardReport(NamedTuple):
    """One actor's answer about its shard (sent as a plain tuple).

    ``shapes``: per stage it wrote (or read), ``{key: shape}`` of the module state; ``error``:
    None, or what failed, naming the actor, the stage and the file; ``nbytes``: bytes of the
    files written (0 for a read or an asynchronous write, which is not done yet)."""

    index: int
    shapes: dict
    error: Optional[str] = None
    nbytes: int = 0


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def shapes_of(states: dict) -> dict:
    return {int(s): {k: shape_of(v) for k, v in st["module"].items()} for s, st in states.items()}


def copy_state(value: Any, copy: bool) -> Any:
    """``value`` with every tensor on the CPU, detached; ``copy``: every tensor and container a
    new one, so that the next steps' in-place updates leave it as it is (a snapshot)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=copy)
    if isinstance(value, dict):
        return {k: copy_state(v, copy) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(copy_state(v, copy) for v in value)
    return value


def _write_file(path: str, obj: Any) -> int:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
        return f.tell()


def write_shard(directory: str, where: Where, states: dict, rng: dict,
                optimizer_shards: Optional[dict] = None, tp_rank: int = 0, ep_rank: int = 0) -> tuple[Optional[str], int]:
    """Write ``states`` (stage -> its checkpoint state), ``optimizer_shards`` (stage -> this
    replica's ZeRO-1 shard of its optimizer state) and ``rng`` into ``directory``, each file
    fsynced (TP rank ``tp_rank``'s parts of them: Note [checkpoint pieces]; EP rank ``ep_rank``'s
    part of the stage files: Note [expert pieces]); ``(error or None, bytes written)``."""
    nbytes = 0
    files = [(part_file(stage_file(s), tp_rank, ep_rank), states[s], f"stage {s}") for s in sorted(states)]
    files += [(part_file(optimizer_shard_file(s, where.optimizer_shard), tp_rank), shard, f"stage {s}'s optimizer shard")
              for s, shard in sorted((optimizer_shards or {}).items())]
    for name, obj, what in files:
        path = os.path.join(directory, name)
        try:
            nbytes += _write_file(path, obj)
        except BaseException as e:  # noqa: BLE001 - reported to the controller
            return f"{where} could not write {what} to {path}: {describe(e)}", nbytes
    path = os.path.join(directory, rng_file(where.index))
    try:
        nbytes += _write_file(path, rng)
    except BaseException as e:  # noqa: BLE001
        return f"{where} could not write its RNG state to {path}: {describe(e)}", nbytes
    return None, nbytes


def leave_marker(directory: str, index: int, error: Optional[str]) -> None:
    """``.done-NNNN`` (empty), or ``.failed-NNNN`` holding ``error`` (renamed into place whole)."""
    if error is None:
        os.close(os.open(os.path.join(directory, done_marker(index)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        return
    final = os.path.join(directory, failed_marker(index))
    with open(final + ".tmp", "w") as f:
        f.write(error)
    os.rename(final + ".tmp", final)


class ShardWriter:
    """Writes a snapshot in a thread of its own (no lock held, so steps go on), then leaves
    its marker.  ``status`` is ``WRITING``, ``DONE`` or ``FAILED`` (``error`` says why)."""

    def __init__(self, directory: str, where: Where, states: dict, rng: dict,
                 optimizer_shards: Optional[dict] = None, tp_rank: int = 0, ep_rank: int = 0) -> None:
        self.status, self.error = WRITING, None
        self._thread = threading.Thread(target=self._run, name="mpmd-checkpoint-writer", daemon=True,
                                        args=(directory, where, states, rng, optimizer_shards, tp_rank, ep_rank))
        self._thread.start()

    def _run(self, directory: str, where: Where, states: dict, rng: dict, optimizer_shards: Optional[dict],
             tp_rank: int, ep_rank: int) -> None:
        try:
            error, _ = write_shard(directory, where, states, rng, optimizer_shards, tp_rank, ep_rank)
        except BaseException:  # noqa: BLE001 - a bug here must still end the save
            error = f"{where} failed writing its shard:\n{traceback.format_exc()}"
        try:
            leave_marker(directory, where.index, error)
        except OSError as e:  # the controller's status probe still learns the outcome
            if error is not None:
                error = f"{error} (and its failure marker could not be written: {describe(e)})"
        self.error = error
        self.status = FAILED if error else DONE  # last: DONE means the marker is there (or could not be)

    def join(self) -> None:
        self._thread.join()


def load_parts(directory: str, name: str, parts: int, head: Any = None, ep_parts: int = 1) -> Any:
    """The file ``name`` memory-mapped (read only where touched; ``head``: it, loaded already),
    its ``parts`` TP parts and ``ep_parts`` EP parts merged (Note [checkpoint pieces], Note
    [expert pieces] in actors/expert_state.py)."""
    value = head if head is not None else torch.load(os.path.join(directory, name), map_location="cpu",
                                                     weights_only=True, mmap=True)
    for t, e in part_ranks(parts, ep_parts):
        value = merge_parts(value, torch.load(os.path.join(directory, part_file(name, t, e)), map_location="cpu",
                                              weights_only=True, mmap=True))
    return mark_mapped(value)


def read_shard(directory: str, where: Where, stages: list[int], rng: bool) -> tuple[Optional[str], dict, Any]:
    """Read the files of ``stages`` (and, ``rng``, this actor's RNG file) from ``directory``
    with ``torch.load(weights_only=True)``, memory-mapped so that only what this actor keeps is
    read; ``(error or None, stage -> state, rng state)``.  A stage saved under ZeRO-1
    (``"optimizer_shards": D``) gets every replica's shard of its optimizer state, as a list,
    under ``"optimizer_named"`` (Note [ZeRO-1 sharding]); one saved under TP, every TP
    rank's pieces (``"tp_parts": T``: Note [checkpoint pieces]); one saved under EP, every EP
    rank's expert pieces (``"ep_parts": P``: Note [expert pieces] in actors/expert_state.py)."""
    states: dict = {}
    for s in stages:
        name = stage_file(s)
        try:
            head = torch.load(os.path.join(directory, name), map_location="cpu", weights_only=True, mmap=True)
            parts = int(head.get("tp_parts") or 1)
            states[s] = load_parts(directory, name, parts, head, int(head.get("ep_parts") or 1))
            names = [optimizer_shard_file(s, d) for d in range(states[s].get("optimizer_shards") or 0)]
            if names:
                states[s]["optimizer_named"] = []
            for name in names:
                states[s]["optimizer_named"].append(load_parts(directory, name, parts))
        except BaseException as e:  # noqa: BLE001 - reported to the controller
            return f"{where} could not read stage {s} from {os.path.join(directory, name)}: {describe(e)}", {}, None
    rng_state = None
    if rng:
        path = os.path.join(directory, rng_file(where.index))
        try:
            rng_state = torch.load(path, map_location="cpu", weights_only=True)
        except BaseException as e:  # noqa: BLE001
            return f"{where} could not read its RNG state from {path}: {describe(e)}", {}, None
    return None, states, rng_state

