"""Weights out as Hugging Face safetensors, written by the actors.

Note [export from the actors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``pipe.state_dict()`` brings the whole model to the controller, which at 70B is 282 GB in
fp32 arriving in one process.  ``export_safetensors`` leaves the weights where they are: the
first replica's actors write the model's files themselves, one file per actor
(``model-00001-of-0000N.safetensors``, ``N`` = pp x tp), and the controller writes only
``model.safetensors.index.json`` (key -> file, the total size) from what they report.

* Every key is written once: a key several stages hold (a tied weight) by the first stage
  that has it; ``skip`` keys (a head tied to the embedding, which the model's config
  re-ties) by none.
* Under TP a stage's TP group takes its tensors whole one at a time (a DTensor is gathered
  over the group, every TP rank in the same order) and TP rank ``i % tp`` keeps the ``i``-th,
  so the group's ranks share the writing and each holds about ``1/tp`` of the stage's
  weights, whole, while it writes.
* ``dtype`` casts on the actor (``"bfloat16"`` halves the files); the default keeps the
  training dtype.

The keys are the pipeline's (``pipe.state_dict()``'s): the model's own for stages that keep
them (``mpmd.split``, ``mpmd train``'s factories), which ``from_pretrained`` reads."""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

__all__ = ["export_safetensors", "INDEX"]

INDEX = "model.safetensors.index.json"


def export_safetensors(engine, directory: str, *, skip: Iterable[str] = (), dtype: Optional[str] = None) -> dict:
    """Have the first replica's actors write the pipeline's weights into ``directory`` as
    sharded safetensors with an index (Note [export from the actors]); the index's weight map."""
    engine.check_open()
    os.makedirs(directory, exist_ok=True)
    grid, keys = engine.grid, engine.state_keys
    skip, owner = set(skip), {}
    for s, names in enumerate(keys.stage_keys):  # each key once, by the first stage holding it
        for name in names:
            key = keys.key(s, name)
            if key not in skip:
                owner.setdefault(key, (s, name))
    by_stage: dict = {}
    for key, (s, name) in owner.items():
        by_stage.setdefault(s, {})[name] = key
    writers = [(r, t) for r in range(grid.pp) for t in range(grid.tp)]
    files = {w: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, w in enumerate(writers)}
    indices, calls = [], []
    for r, t in writers:
        names = {s: by_stage.get(s, {}) for s in engine.schedule.stages_of(r)}
        indices.append(grid.actor(0, r, t))
        calls.append((os.path.join(directory, files[(r, t)]), names))
    futures = {engine.actors[i].export_stage.remote(path, names, dtype): i for i, (path, names) in zip(indices, calls)}
    written = engine.wait(list(futures), "export_stage", owner=futures)
    weight_map, total = {}, 0
    for (r, t), sizes in zip(writers, written):
        for key, nbytes in sizes.items():
            weight_map[key] = files[(r, t)]
            total += nbytes
    missing = sorted(set(owner) - set(weight_map))
    if missing:
        raise RuntimeError(f"the export wrote no tensor for {missing[:5]}")
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return weight_map
