"""Batches the actors pull themselves: ``Pipeline.fit`` on a ``ray.data.Dataset``.

Note [fed steps]
In a fed step the controller sends no data: every actor gets the payload-free step call
(Note [bare calls] in mpmd/runtime/dispatch.py).  In each replica, the actor of the first
stage holds a ``Feed``: that replica's ``streaming_split`` iterator.  At the step's start
it pulls the replica's rows, keeps the input column and cuts it into microbatches exactly
as the controller would (``chunk`` along dim 0, mpmd/runtime/batches.py), and the target
column goes to the actor of the last stage, unless that is itself (V-shaped schedules).
The targets travel over the pipeline's own group as the first message of the step on both
sides: the feeding actor sends a header (structure and shapes) and the tensors before its
program starts; the actor of the last stage (``TargetsFrom``) receives them before posting
its program's receives.  Both sides put them first in every fed step, and each pair of
ranks matches its k-th send with its k-th receive, so the order holds on gloo and NCCL.
The header goes every step, so targets may change shape; inputs that change shape are
caught by the stages' own check (``dynamic_shapes``).

Under tensor parallelism every TP rank of the first stage needs the same rows, and every
TP rank of the last stage the same targets.  TP rank 0 of the first stage alone pulls
from the split; as the step's first action, before anything is sent, it broadcasts the
batch over the stage's TP group (``broadcast_object_list``), which its TP peers join as
their first action too.  Then each TP rank ``t`` sends the targets to TP rank ``t`` of
the last stage as above, over its own pair, so the last stage's side is unchanged.

Epochs: ``iter_torch_batches(drop_last=True)`` gives each split ``rows // batch`` batches
per pass; the controller counts the same number per epoch from ``Dataset.count()``, and a
pull past the end starts the next pass (``streaming_split`` starts an epoch once every
split asks).  ``skip`` drops the first batches (``fit``'s resume).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from .values import decode_header, encode_header, flatten, meta_of, to_device, unflatten

__all__ = ["Feed", "TargetsFrom", "chunk"]


def chunk(value: Any, parts: int) -> list:
    """``value`` cut into ``parts`` equal microbatches along dim 0 (as the controller does)."""
    spec, tensors = flatten(value, where="fed batch")
    n = tensors[0].shape[0]
    if n % parts:
        raise ValueError(f"a fed batch of {n} rows does not split into {parts} microbatches")
    pieces = [t.chunk(parts) for t in tensors]
    return [unflatten(spec, [p[i] for p in pieces]) for i in range(parts)]


class Feed:
    """One replica's rows, pulled by the actor of its first stage (Note [fed steps]).

    ``iterator``: its ``ray.data.DataIterator`` (None on a TP rank other than 0, which gets
    the batch from ``shared_by``); ``rows``: rows per step; ``parts``: microbatches per step;
    ``columns``: (input column, target column); ``targets_to``: the global rank of the
    replica's last-stage actor, None when it is this actor; ``shared_by``: under TP, the
    global rank of TP rank 0 of this stage, which broadcasts each batch to its TP group."""

    def __init__(self, iterator: Any, *, rows: int, parts: int, columns: tuple[str, str],
                 targets_to: Optional[int], skip: int = 0, shared_by: Optional[int] = None) -> None:
        self.iterator, self.rows, self.parts, self.columns = iterator, rows, parts, columns
        self.targets_to, self.skip, self.shared_by = targets_to, skip, shared_by
        self._epoch = None

    def _next(self) -> dict:
        for _ in range(2):
            if self._epoch is None:
                self._epoch = iter(self.iterator.iter_torch_batches(batch_size=self.rows, drop_last=True))
            try:
                return next(self._epoch)
            except StopIteration:
                self._epoch = None  # the pass is over: the next pull starts another
        raise RuntimeError(f"this replica's split of the dataset gave no batch of {self.rows} rows; the dataset "
                           f"is empty or smaller than one step")

    def start(self) -> None:
        for _ in range(self.skip if self.iterator is not None else 0):
            self._next()

    def close(self) -> None:
        self._epoch = None  # lets go of the pass in progress

    def pull(self, comm, prepare: Optional[Callable] = None, step: int = 0) -> tuple[list, Optional[list]]:
        """This step's (input microbatches, target microbatches or None when they were sent on);
        ``prepare`` pins what this actor keeps before it is cut (Note [step inputs]).  ``step``
        (the step's number) is for feeds that read by step (mpmd/lm/tokens.py); this one
        takes the iterator's next batch."""
        pair = None
        if self.iterator is not None:
            batch = self._next()
            missing = [c for c in self.columns if c not in batch]
            if missing:
                raise KeyError(f"the dataset's batches have no column {missing[0]!r} (columns: {sorted(batch)})")
            pair = (batch[self.columns[0]], batch[self.columns[1]])
        if self.shared_by is not None:  # the TP group's first action of the step
            import torch.distributed as dist

            box = [pair]
            dist.broadcast_object_list(box, src=self.shared_by, group=comm.tp_group)
            pair = box[0]
        inputs, targets = pair
        keep = prepare or (lambda v: v)
        if self.targets_to is None:
            return chunk(keep(inputs), self.parts), chunk(keep(targets), self.parts)
        spec, tensors = flatten(to_device(targets, comm.wire), where="targets")
        comm.send_header(encode_header(spec, meta_of(tensors)), self.targets_to)
        comm.send(tensors, self.targets_to)  # completed by the step's flush
        return chunk(keep(inputs), self.parts), None


class TargetsFrom:
    """On the last stage's actor: each fed step's targets, from the replica's feeding actor."""

    def __init__(self, src: int, parts: int) -> None:
        self.src, self.parts = src, parts

    def start(self) -> None:
        pass

    def close(self) -> None:
        pass

    def pull(self, comm, prepare: Optional[Callable] = None, step: int = 0) -> tuple[None, list]:
        spec, metas = decode_header(comm.recv_header(self.src))
        targets: Any = unflatten(spec, comm.recv(metas, self.src))
        return None, chunk(prepare(targets) if prepare is not None else targets, self.parts)

