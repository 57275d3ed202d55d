"""The reference of every ``mpmd train`` config key, generated from the config dataclasses
(``mpmd train --config-reference > docs/config.md``; a test keeps docs/config.md equal to
it): each section's docstring, then per key its type, default and the comment written
beside the field in ``config.py``."""

from __future__ import annotations

import dataclasses
import inspect
import re

from .config import MODEL_SIZES, TrainConfig
from .model_config import MOE_SIZES

__all__ = ["reference"]

_FIELD = re.compile(r"^\s+(\w+):\s*[^#]*?#\s*(.+)$")


def _comments(cls) -> dict[str, str]:
    """The comment beside each field of ``cls`` in its source (``name: type = value  # comment``)."""
    out = {}
    for line in inspect.getsource(cls).splitlines():
        m = _FIELD.match(line)
        if m:
            out[m.group(1)] = m.group(2).strip()
    return out


def _value(v) -> str:
    if v is None:
        return "(none)"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'`"{v}"`'
    if isinstance(v, (tuple, list)):
        return "`[" + ", ".join(f'"{x}"' if isinstance(x, str) else str(x) for x in v) + "]`"
    return f"`{v}`"


def reference() -> str:
    """docs/config.md: every section and key of ``TrainConfig``."""
    lines = ["# `mpmd train` config reference", "",
             "Generated from the config dataclasses (`mpmd/lm/config.py`, `model_config.py`) by `mpmd train --config-reference`;",
             "a test keeps this page equal to it. A TOML file sets any of these keys by section",
             "(`[optim]` / `lr = 3e-3`), and `--set section.key=value` overrides one (TOML syntax).",
             "`mpmd train CONFIG --print-config` prints a config with every value resolved. A number outside its",
             "range (NaN and infinity included) is refused naming its key, before anything starts; the maxima are",
             "far above any real run (`MAX_*` in `mpmd/lm/limits.py` and `mpmd/runtime/limits.py` say why each).", ""]
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory
        notes = _comments(cls)
        lines += [f"## `[{section.name}]`", "", inspect.getdoc(cls) or "", "",
                  "| key | type | default | range | note |", "|---|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            note = notes.get(f.name, "").replace("|", "\\|")
            span = cls.LIMITS[f.name].span if f.name in cls.LIMITS else ""
            lines.append(f"| `{f.name}` | `{f.type}` | {_value(default)} | {span} | {note} |")
        lines.append("")
    lines += ["## Model sizes", "", "`model.size` names a shape; any shape key given in `[model]` overrides it.", "",
              "| size | " + " | ".join(MODEL_SIZES["debug"]) + " |", "|---" * (len(MODEL_SIZES["debug"]) + 1) + "|"]
    for name, shape in MODEL_SIZES.items():
        lines.append(f"| `{name}` | " + " | ".join(str(v) for v in shape.values()) + " |")
    for family, sizes in MOE_SIZES.items():  # the mixture-of-experts families (docs/moe.md)
        keys = [k for k in next(iter(sizes.values())) if any(shape.get(k) is not None for shape in sizes.values())]
        lines += ["", f"`model.family = \"{family}\"` (docs/moe.md):", "", "| size | " + " | ".join(keys) + " |",
                  "|---" * (len(keys) + 1) + "|"]
        for name, shape in sizes.items():
            lines.append(f"| `{name}` | " + " | ".join(_value(shape[k]).strip("`") for k in keys) + " |")
    return "\n".join(lines) + "\n"
