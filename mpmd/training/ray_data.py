"""``Pipeline.fit(ds)`` for a ``ray.data.Dataset``: the actors pull their own batches.

The dataset's rows are cut into one ``streaming_split`` per data-parallel replica; the
actor of each replica's first stage pulls the replica's rows for a step, keeps the input
column and sends the target column to the replica's last-stage actor (Note [fed steps] in
actors/feed.py).  The controller only counts steps: ``Dataset.count()`` rows make
``count // dp // (batch_size // dp)`` steps per epoch (``equal=True`` splits, the last
partial batch dropped), and each step it issues carries no data.

A batch of ``batch_size`` rows is the same global batch a tensor ``fit`` gets: each
replica takes ``batch_size // dp`` rows and cuts them into ``num_microbatches`` equal
microbatches.  With ``dp=1`` the rows come in the dataset's order, so ``fit(ds)`` trains
exactly like ``fit`` on the same rows as tensors; with ``dp > 1`` Ray Data decides which
rows each replica gets (each gets an equal share of every epoch).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Optional

from actors.feed import Feed, TargetsFrom

from ..runtime import FED, Engine, MicrobatchSplit

__all__ = ["is_dataset", "fit_data", "FedData", "FED_BATCH"]

# What fit's loop sees as the batch of a fed step.
FED_BATCH = (FED, None)


def is_dataset(data: Any) -> bool:
    """Whether ``data`` is a ``ray.data.Dataset`` (without importing Ray Data otherwise)."""
    if not type(data).__module__.startswith("ray.data"):
        return False
    import ray.data

    return isinstance(data, ray.data.Dataset)


def fit_data(engine: Engine, data: Any, *, batch_size: Optional[int], columns: Any, max_restarts: int,
             filling: bool) -> Any:
    """``data`` as ``fit_loop`` takes it: a ``FedData`` for a ``ray.data.Dataset``, else as it is."""
    if not is_dataset(data):
        if batch_size is not None:
            raise ValueError("batch_size is for fit on a ray.data.Dataset; an iterable of (inputs, targets) "
                             "batches sets its own batch size")
        return data
    if max_restarts:
        raise ValueError("max_restarts is not supported with a ray.data.Dataset: the rows the dead actors had "
                         "pulled since the last checkpoint cannot be replayed; use max_restarts=0 (resume=True "
                         "from checkpoint_dir still works)")
    if filling:
        raise ValueError("fit on a ray.data.Dataset does not run with fill jobs (PipeFill); remove them or "
                         "iterate the dataset on the controller: fit(ds.iter_torch_batches(...))")
    return FedData(engine, data, batch_size=batch_size, columns=columns)


class FedData:
    """A ``ray.data.Dataset`` as ``fit``'s data: ``len()`` is the steps per epoch, and each
    item is ``FED_BATCH``; ``start(skip)`` hands the actors their splits, ``stop()`` takes them back."""

    def __init__(self, engine: Engine, ds: Any, *, batch_size: Optional[int], columns: Any) -> None:
        layout, m = engine.config.layout, engine.schedule.num_microbatches
        if not isinstance(engine.batching, MicrobatchSplit):
            raise ValueError("fit on a ray.data.Dataset does not support token slices (TeraPipe); iterate the "
                             "dataset on the controller instead: fit(ds.iter_torch_batches(...))")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ValueError(f"fit on a ray.data.Dataset needs batch_size, the rows of one step (all replicas), "
                             f"e.g. fit(ds, batch_size={m * layout.dp * 8}); got {batch_size!r}")
        per_step = m * layout.dp
        if batch_size % per_step:
            lo, hi = (batch_size // per_step) * per_step, (batch_size // per_step + 1) * per_step
            raise ValueError(f"batch_size={batch_size} does not split into num_microbatches={m} "
                             f"x dp={layout.dp} equal microbatches; use a multiple of {per_step}, e.g. {lo or hi} "
                             f"or {hi}")
        if (not isinstance(columns, (tuple, list)) or len(columns) != 2
                or not all(isinstance(c, str) for c in columns)):
            raise ValueError(f"columns must name the input and the target column, e.g. columns=('x', 'y'); "
                             f"got {columns!r}")
        names = ds.columns()
        missing = [c for c in columns if names is not None and c not in names]
        if missing:
            raise ValueError(f"the dataset has no column {missing[0]!r} (its columns: {names}); pass "
                             f"fit(ds, columns=(input column, target column))")
        self.engine, self.ds, self.columns = engine, ds, tuple(columns)
        self.rows = batch_size // layout.dp  # per replica and step
        self.steps = ds.count() // layout.dp // self.rows
        if self.steps == 0:
            raise ValueError(f"the dataset's {ds.count()} rows make no step of batch_size={batch_size}"
                             + (f" over dp={layout.dp} replicas" if layout.dp > 1 else "") + "; pass a smaller batch_size")
        self.attached: list[int] = []

    def __len__(self) -> int:
        return self.steps

    def __iter__(self) -> Iterator:
        return itertools.repeat(FED_BATCH, self.steps)

    def start(self, skip: int = 0) -> None:
        """Give each replica's first- and last-stage actors their feeds; the first ``skip``
        batches are dropped (fit's resume)."""
        engine, layout, grid = self.engine, self.engine.config.layout, self.engine.grid
        m = engine.schedule.num_microbatches
        first, last = engine.schedule.stage_to_rank[0], engine.schedule.stage_to_rank[-1]
        if layout.cp > 1:  # each CP rank would need the batch: a Feed shares it over TP only
            raise ValueError(f"fit on a ray.data.Dataset with cp={layout.cp} is not supported yet; pass the batches "
                             "as tensors (or mpmd train's token files), or use cp=1")
        splits = self.ds.streaming_split(layout.dp, equal=True)
        feeds: dict[int, Any] = {}
        for replica, split in enumerate(splits):
            for t in range(layout.tp):  # TP rank 0 pulls and shares the batch with its TP peers
                feeder, receiver = grid.actor(replica, first, t), grid.actor(replica, last, t)
                feeds[feeder] = Feed(split if t == 0 else None, rows=self.rows, parts=m,
                                     columns=self.columns, targets_to=None if receiver == feeder else receiver,
                                     skip=skip, shared_by=grid.actor(replica, first, 0) if layout.tp > 1 else None)
                if receiver != feeder:
                    feeds[receiver] = TargetsFrom(feeder, m)
        # The actors' indices in the engine's list equal their global ranks (Note [device grid]).
        engine.client.attach_feeds(feeds, "handing out the dataset")
        self.attached = list(feeds)

    def stop(self) -> None:
        """Take the feeds back (at the end of fit, also when it raises)."""
        attached, self.attached = self.attached, []
        if attached and not self.engine.fleet.closed:
            self.engine.client.detach_feeds(attached, "ending the dataset's feed")
