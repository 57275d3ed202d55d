"""What ``mpmd train`` logs of a mixture of experts each step, from the runtime's
``StepResult.moe_metrics`` (per MoE block: ``<block>.load``, the tokens each expert got this
step, summed over the replicas and microbatches; ``<block>.aux``, the mean auxiliary loss of a
microbatch; ``<block>.bias``, the router's expert bias; actors/experts.py ``finish_step``).

Note [expert load metrics]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The step record (metrics.csv, TensorBoard ``train/...``) gets a few numbers per MoE layer and
two for the model, so its columns stay readable at DeepSeek-V3's 58 MoE layers:

- ``moe_load_max_mean``: the worst layer's ``max / mean`` tokens per expert (1.0: perfectly
  balanced; E/k: every token to the same k experts), and ``moe_aux_loss``: the layers' auxiliary
  losses summed (what one microbatch adds to its loss; empty without ``optim.moe_aux_loss_coef``);
- per layer ``moe.layer<i>.load_max_mean``, ``moe.layer<i>.aux`` and, where the router has a bias
  (DeepSeek-V3), ``moe.layer<i>.bias_range`` (its max - min: how far the bias update has moved it).

The per-expert counts themselves go to ``expert_load.csv`` beside metrics.csv: a row per logged
step, a column ``layer<i>.expert<e>`` per expert, written by a second ``CSVLogger`` (so a resumed
run rewrites it from its first step as it does metrics.csv)."""

from __future__ import annotations

import re
from typing import Optional

__all__ = ["moe_record", "expert_load_record", "MOE_RECORD_FIELDS"]

MOE_RECORD_FIELDS = ("moe_load_max_mean", "moe_aux_loss")
_SUFFIXES = (".load", ".aux", ".bias")
_LAYER = re.compile(r"layers\.(\d+)\.")


def _blocks(metrics: dict) -> dict[str, dict]:
    """``{short block name: {"load": [...], "aux": x, "bias": [...]}}`` in layer order."""
    out: dict[str, dict] = {}
    for key, value in metrics.items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            continue
        block = key[:-len(suffix)]
        found = _LAYER.search(block + ".")
        name = f"layer{found.group(1)}" if found else block
        out.setdefault(name, {})[suffix[1:]] = value
    return dict(sorted(out.items(), key=lambda kv: _order(kv[0])))


def _order(name: str) -> tuple:
    return (0, int(name[5:])) if name.startswith("layer") and name[5:].isdigit() else (1, name)


def _max_mean(load) -> Optional[float]:
    load = [float(x) for x in load]
    mean = sum(load) / len(load) if load else 0.0
    return max(load) / mean if mean > 0 else None


def moe_record(metrics: dict) -> dict:
    """The step record's MoE fields (Note [expert load metrics]); {} without MoE blocks."""
    blocks = _blocks(metrics)
    if not blocks:
        return {}
    record: dict = dict.fromkeys(MOE_RECORD_FIELDS)
    ratios, auxes = [], []
    for name, block in blocks.items():
        ratio = _max_mean(block.get("load", ()))
        record[f"moe.{name}.load_max_mean"] = ratio
        ratios += [ratio] if ratio is not None else []
        if "aux" in block:
            record[f"moe.{name}.aux"] = float(block["aux"])
            auxes.append(float(block["aux"]))
        if "bias" in block:
            bias = [float(x) for x in block["bias"]]
            record[f"moe.{name}.bias_range"] = max(bias) - min(bias) if bias else 0.0
    record["moe_load_max_mean"] = max(ratios) if ratios else None
    record["moe_aux_loss"] = sum(auxes) if auxes else None
    return record


def expert_load_record(step: int, metrics: dict) -> Optional[dict]:
    """A row of expert_load.csv: the step and every expert's tokens (None without MoE blocks)."""
    blocks = _blocks(metrics)
    if not blocks:
        return None
    row: dict = {"step": step}
    for name, block in blocks.items():
        row.update({f"{name}.expert{e}": int(round(float(n))) for e, n in enumerate(block.get("load", ()))})
    return row
