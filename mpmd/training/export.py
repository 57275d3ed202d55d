"""Weights out as Hugging Face safetensors, written by the actors, and in from them, read by
the actors.

Note [export from the actors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``pipe.state_dict()`` brings the whole model to the controller, which at 70B is 282 GB in
fp32 arriving in one process.  ``export_safetensors`` leaves the weights where they are: the
first replica's actors write the model's files themselves, one file per actor
(``model-00001-of-0000N.safetensors``, ``N`` = pp x tp x ep), and the controller writes only
``model.safetensors.index.json`` (key -> file, the total size) from what they report.

* Every key is written once: a key several stages hold (a tied weight) by the first stage
  that has it; ``skip`` keys (a head tied to the embedding, which the model's config
  re-ties) by none.
* Under TP a stage's TP group takes its tensors whole one at a time (a DTensor is gathered
  over the group, every TP rank in the same order) and TP rank ``i % tp`` keeps the ``i``-th,
  so the group's ranks share the writing and each holds about ``1/tp`` of the stage's
  weights, whole, while it writes.
* Under EP the first ``ep`` replicas write (``N`` = pp x tp x ep files; EP rank ``e`` every
  ``ep``-th key of its stages): each puts its expert slices into Ray's object store, and the
  writer of an expert tensor fetches them one at a time and writes the whole fused tensor
  (``[E, ...]``, the key the model's own module has), so no actor holds more than its share
  of the stage whole, and no collective runs (Note [expert pieces] in actors/expert_state.py).
* A Hugging Face MoE model's fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj``) are
  written one tensor per expert under the Hub's names, as ``save_pretrained`` writes them
  (Note [expert file layouts] in actors/hf_experts.py).
* ``dtype`` casts on the actor (``"bfloat16"`` halves the files); the default keeps the
  training dtype.

The keys are the pipeline's (``pipe.state_dict()``'s): the model's own for stages that keep
them (``mpmd.split``, ``mpmd train``'s factories), which ``from_pretrained`` reads.

Note [weights from safetensors]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``load_safetensors`` is the way in for pretrained weights (a ``save_pretrained`` directory,
or one ``export_safetensors`` wrote): the controller reads only the file names and headers
(the index, or a single file's key list), and every actor opens the files itself and copies
into each of its stages' tensors what belongs there: a DTensor only its own box of the
file's tensor (safetensors' ``get_slice`` reads those bytes alone), a plain tensor the whole.
A fused expert parameter is read from the file's fused tensor or from its per-expert tensors
(the Hub's layout; Note [expert file layouts] in actors/hf_experts.py), an actor holding a
slice of the experts (expert parallelism) reading only its experts' rows or tensors.
So no process holds more than its own part, and nothing passes through the controller or
Ray's object store.  A key the files lack is taken from a key tied to it (a head tied to the
embedding, which ``save_pretrained`` writes once); a key with neither, or a shape that
differs, is an error naming both before any actor is asked to read, where the headers can
tell."""

from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from actors.file_checks import open_regular, plain_name, regular_stat
from actors.hf_experts import fused_shape, hub_keys, hub_source

__all__ = ["export_safetensors", "load_safetensors", "export_checkpoint", "INDEX"]

INDEX = "model.safetensors.index.json"


def export_safetensors(engine, directory: str, *, skip: Iterable[str] = (), dtype: Optional[str] = None) -> dict:
    """Have the first replica's actors write the pipeline's weights into ``directory`` as
    sharded safetensors with an index (Note [export from the actors]); the index's weight map."""
    engine.fleet.check_open()
    _torch_dtype(dtype)  # refused before any actor writes
    os.makedirs(directory, exist_ok=True)
    grid, keys = engine.grid, engine.state_keys
    skip, owner = set(skip), {}
    for s, names in enumerate(keys.stage_keys):  # each key once, by the first stage holding it
        for name in names:
            key = keys.key(s, name)
            if key not in skip:
                owner.setdefault(key, (s, name))
    by_stage = _file_keys(engine, owner)
    expected = {k for stage in by_stage.values() for key in stage.values()
                for k in ((key,) if isinstance(key, str) else (k for part in key for k in part))}
    writers = [(r, t, e) for r in range(grid.pp) for t in range(grid.tp) for e in range(grid.ep)]
    files = {w: f"model-{i + 1:05d}-of-{len(writers):05d}.safetensors" for i, w in enumerate(writers)}
    experts = _expert_slices(engine, by_stage)
    calls = {}
    for r, t, e in writers:  # EP rank e (member e) writes every ep-th key of its stages (it holds the dense ones)
        names = {s: dict(list(by_stage.get(s, {}).items())[e::grid.ep]) for s in engine.schedule.stages_of(r)}
        mine = {s: {n: experts[s][n] for n in names[s] if n in experts.get(s, {})} for s in names}
        calls[grid.ep_member(e, r, t)] = (os.path.join(directory, files[(r, t, e)]), names, mine)
    written = engine.client.export_stages(calls, dtype)
    weight_map, total = {}, 0
    for w, sizes in zip(writers, written):
        for key, nbytes in sizes.items():
            weight_map[key] = files[w]
            total += nbytes
    missing = sorted(expected - set(weight_map))
    if missing:
        raise RuntimeError(f"the export wrote no tensor for {missing[:5]}")
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return weight_map


def _file_keys(engine, owner: dict) -> dict:
    """``{stage: {its key: what the export writes}}`` for the keys each stage writes (``owner``:
    key -> (stage, its key)): the key, or for a Hugging Face MoE stage the names its Hub files
    use (``stage.expert_file_layout``, Note [expert file layouts]: a fused expert parameter as
    per-expert keys), as ``save_pretrained`` writes."""
    by_stage: dict = {}
    shapes: dict = {}
    for key, (s, name) in owner.items():
        stage = engine.fleet.source.modules[s]
        layout = getattr(stage, "expert_file_layout", None)
        if layout is not None and s not in shapes:
            shapes[s] = {k: tuple(v.shape) for k, v in stage.state_dict(keep_vars=True).items()}
        experts = (shapes[s][name] or (0,))[0] if layout is not None else 0
        by_stage.setdefault(s, {})[name] = key if layout is None else hub_keys(key, experts, layout)
    return by_stage


def _expert_slices(engine, by_stage: dict) -> dict:
    """``{stage: {name: [(offset, whole shape, reference)] over its EP ranks}}``: EP group 0's
    expert slices, in Ray's object store until the export is written (empty at ep=1)."""
    grid = engine.grid
    if grid.ep == 1:
        return {}
    asked = {grid.ep_member(e, r): {s: list(by_stage.get(s, {})) for s in engine.schedule.stages_of(r)}
             for e in range(grid.ep) for r in range(grid.pp)}
    out: dict = {}
    for answer in engine.client.expert_slices(asked):
        for s, slices in answer.items():
            for name, piece in slices.items():
                out.setdefault(s, {}).setdefault(name, []).append(piece)
    return out


def _weight_map(directory: str) -> dict:
    """File key -> file, from the index or, without one, the single ``model.safetensors``'s header;
    every file a plain name of ``directory`` ending in .safetensors and a regular file there
    (Note [names from files] in actors/file_checks.py), checked before any weight is read."""
    index = os.path.join(directory, INDEX)
    if os.path.lexists(index):
        fix = (f"give a model directory whose {INDEX} names its own .safetensors files (save_pretrained or "
               f"`mpmd export` writes one)")
        try:
            with open_regular(index, "r", where=f"the model directory {directory}", fix=fix) as f:
                weight_map = json.load(f).get("weight_map")
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
            raise ValueError(f"{index} is not a JSON object with a weight_map ({e}); {fix}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(k, str) for k in weight_map):
            raise ValueError(f"{index}: weight_map is not an object of tensor names to file names; {fix}")
        for key, file in weight_map.items():
            where = f"{index}: weight_map[{key!r}]"
            plain_name(file, ".safetensors", where=where, fix=fix)
        for file in sorted(set(weight_map.values())):
            if regular_stat(os.path.join(directory, file), where=f"{index} names {file}", fix=fix) is None:
                raise ValueError(f"{index} names {file}, which {directory} lacks; {fix}")
        return dict(weight_map)
    single = os.path.join(directory, "model.safetensors")
    fix = "give a model directory (save_pretrained(..., safe_serialization=True) writes one)"
    if regular_stat(single, where=f"the model directory {directory}", fix=fix) is None:
        raise FileNotFoundError(f"{directory} has neither {INDEX} nor model.safetensors: not a safetensors "
                                f"model directory (save_pretrained(..., safe_serialization=True) writes one)")
    from safetensors import safe_open

    with safe_open(single, framework="pt", device="cpu") as f:
        return {k: "model.safetensors" for k in f.keys()}


def _torch_dtype(dtype: Optional[str]):
    """The torch dtype named ``dtype`` (None: None), or a ValueError before anything is written."""
    if dtype is None:
        return None
    import torch

    found = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise ValueError(f"dtype {dtype!r} is not a torch dtype; give e.g. 'bfloat16', 'float16' or 'float32'")
    return found


def load_safetensors(engine, directory: str) -> None:
    """Every actor copies its part of the model in ``directory`` into its stages (Note
    [weights from safetensors])."""
    engine.fleet.check_open()
    weight_map = _weight_map(directory)
    keys = engine.state_keys
    tied = {}
    for tie in engine.ties:
        for group in keys.tied_keys(tie):
            for k in group:
                tied[k] = [other for other in group if other in weight_map]
    names = {}
    for s, stage_names in enumerate(keys.stage_keys):
        names[s] = {}
        for name in stage_names:
            key = keys.key(s, name)
            source = key if key in weight_map else next(iter(tied.get(key, [])), None)
            # Under the Hub's names: a renamed block, one tensor per expert (Note [expert file layouts]).
            names[s][name] = source if source is not None else hub_source(key, weight_map)
    # A key still missing may be tied inside its stage (the module holds one tensor under two
    # names): the actor checks that it was filled through the other name.
    _check_shapes(engine, directory, weight_map, names)
    engine.client.import_stages(str(directory), names, weight_map)


def _check_shapes(engine, directory: str, weight_map: dict, names: dict) -> None:
    """Refuse files whose tensors' shapes differ from the stages' (whole shapes, from the
    files' headers and the actors' ``state_shapes``; a fused expert parameter's from its
    per-expert tensors), naming every mismatch in stage order, and float8 tensors (stored with
    scales that a plain copy would drop), before any actor reads a byte."""
    from safetensors import safe_open

    shapes = engine.client.stage_shapes()
    wanted = {k for stage in names.values() for key in stage.values() if key is not None
              for k in ((key,) if isinstance(key, str) else (k for part in key for k in part))}
    on_disk, float8 = {}, []
    for file in sorted({weight_map[key] for key in wanted}):
        with safe_open(os.path.join(directory, file), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in wanted:
                    header = f.get_slice(key)
                    on_disk[key] = tuple(header.get_shape())
                    if header.get_dtype().startswith("F8"):
                        float8.append(f"{key!r} ({header.get_dtype()})")
    if float8:
        raise ValueError(f"the safetensors files in {directory} hold float8 tensors ({', '.join(float8[:3])}), "
                         f"which need their block scales (weight_scale_inv) to mean anything; dequantize the "
                         f"checkpoint to bfloat16 first (e.g. DeepSeek-V3's fp8_cast_bf16.py), then load that")

    def disk_shape(key, want: tuple) -> tuple:
        if isinstance(key, str):
            return on_disk.get(key, want)
        try:
            return fused_shape(key, lambda k: on_disk[k])
        except (KeyError, ValueError):
            return ("per-expert tensors of mixed shapes",)

    def where(key) -> str:
        return repr(key) if isinstance(key, str) else f"{key[0][0]!r} and the other experts' tensors"

    wrong = [f"{where(key)} in {weight_map[key if isinstance(key, str) else key[0][0]]} has shape "
             f"{disk_shape(key, tuple(shapes[s][name]))}, but stage {s}'s {name!r} has shape {tuple(shapes[s][name])}"
             for s in sorted(names) for name, key in names[s].items()
             if key is not None and disk_shape(key, tuple(shapes[s][name])) != tuple(shapes[s][name])]
    if wrong:
        more = f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""
        raise ValueError(f"the safetensors files in {directory} are of another model: " + "; ".join(wrong[:3]) + more)


def export_checkpoint(path: str, directory: str, *, dtype: Optional[str] = None, max_shard_bytes: int = 2 << 30,
                      model_keys: Optional[bool] = None) -> dict:
    """Write a checkpoint's weights (``Pipeline.save``'s directory, any tp) into ``directory``
    as sharded safetensors with an index, offline and one tensor at a time: the stage files
    are memory-mapped, a tensor written in pieces is assembled whole on its own, and a file is
    flushed once it holds ``max_shard_bytes``.  Keys: the model's own when the pipeline kept
    them (the manifest says so; ``model_keys`` overrides), else ``"<stage>.<key>"``.  The
    weight map."""
    from safetensors.torch import save_file

    from actors.checkpoint_io import load_parts, stage_file
    from actors.pieces import assemble, is_pieces

    from .checkpoint import read_manifest

    manifest = read_manifest(path)
    model_keys = manifest.get("model_keys", False) if model_keys is None else model_keys
    cast = _torch_dtype(dtype)
    heads = _stage_heads(path, manifest)  # every file there, before anything is written
    os.makedirs(directory, exist_ok=True)
    weight_map, pending, size, files, total = {}, {}, 0, [], 0

    def flush() -> None:
        nonlocal pending, size
        if pending:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(pending, os.path.join(directory, name), metadata={"format": "pt"})
            files.append(name)
            weight_map.update({k: name for k in pending})
        pending, size = {}, 0

    for s, (head, parts, ep_parts) in enumerate(heads):
        module = load_parts(path, stage_file(s), parts, head, ep_parts)["module"]
        for name, value in module.items():
            key = name if model_keys else f"{s}.{name}"
            if key in weight_map or key in pending:
                continue  # a tied weight: its first stage's copy
            whole = assemble(value, name=key) if is_pieces(value) else value
            whole = whole.to(dtype=cast or whole.dtype, copy=True).contiguous()
            pending[key] = whole
            size += whole.numel() * whole.element_size()
            total += whole.numel() * whole.element_size()
            if size >= max_shard_bytes:
                flush()
        del head, module
        heads[s] = None
    flush()
    renamed = {name: f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i, name in enumerate(files)}
    for old, new in renamed.items():
        os.replace(os.path.join(directory, old), os.path.join(directory, new))
    weight_map = {k: renamed[v] for k, v in sorted(weight_map.items())}
    with open(os.path.join(directory, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return weight_map


def _stage_heads(path: str, manifest: dict) -> list:
    """Each stage's file of the checkpoint ``path`` (memory-mapped: nothing is read until
    touched) and its TP and EP part counts, after checking that every stage file and part file
    is there as a regular file, so that an export stops before it writes, not half way."""
    import torch

    from actors.checkpoint_io import part_file, part_ranks, stage_file

    stages = manifest.get("num_stages")
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise ValueError(f"{path}: the manifest's num_stages is {stages!r}, not a positive count; "
                         f"the checkpoint is damaged: export another (an earlier step-N)")
    heads = []
    for s in range(stages):
        fix = "the checkpoint is incomplete or damaged: export another (an earlier step-N)"
        if regular_stat(os.path.join(path, stage_file(s)), where=f"checkpoint {path}", fix=fix) is None:
            raise ValueError(f"checkpoint {path} lacks {stage_file(s)} (stage {s} of {stages}); {fix}")
        head = torch.load(os.path.join(path, stage_file(s)), map_location="cpu", weights_only=True, mmap=True)
        parts, ep_parts = head.get("tp_parts") or 1, head.get("ep_parts") or 1
        for what, count in (("tp_parts", parts), ("ep_parts", ep_parts)):
            if not isinstance(count, int) or isinstance(count, bool) or count < 1:
                raise ValueError(f"checkpoint {path}: {stage_file(s)}'s {what} is {count!r}, not a count; {fix}")
        for t, e in part_ranks(parts, ep_parts):
            name = part_file(stage_file(s), t, e)
            if regular_stat(os.path.join(path, name), where=f"checkpoint {path}", fix=fix) is None:
                raise ValueError(f"checkpoint {path} lacks {name} (TP part {t} of {parts}, EP part {e} of "
                                 f"{ep_parts} of stage {s}); {fix}")
        heads.append((head, parts, ep_parts))
    return heads
