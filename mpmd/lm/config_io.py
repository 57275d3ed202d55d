"""Reading ``mpmd train``'s configuration: a TOML file (the standard library's ``tomllib``),
then ``--set section.key=value`` overrides, into a ``TrainConfig``.

Every key is checked against the dataclasses' fields: an unknown or mistyped one is refused
naming the valid keys near it (``difflib``), a value of the wrong type names the type it
needs; then the dataclasses check the values themselves.  ``to_toml`` writes a config back
(``--print-config``), and reading that text gives the same config."""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Iterable, Optional, Union

from .config import ModelConfig, TrainConfig

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

__all__ = ["load_config", "load_model_config", "config_from_dict", "parse_override", "to_toml", "ConfigError"]


class ConfigError(ValueError):
    """A configuration mpmd train refuses (before anything starts)."""


def _read_toml(path: str) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path!r} not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None


def load_config(path: Optional[str], overrides: Iterable[str] = ()) -> TrainConfig:
    """The config in the TOML file ``path`` (None: the defaults), ``overrides`` ("section.key=value",
    the value in TOML syntax; a bare word is a string) applied in order."""
    raw: dict = _read_toml(path) if path is not None else {}
    for text in overrides:
        section, key, value = parse_override(text)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ConfigError(f"--set {text}: [{section}] is not a section")
        raw[section][key] = value
    return config_from_dict(raw, source=path or "the defaults")


def parse_override(text: str) -> tuple[str, str, Any]:
    """``"optim.lr=1e-3"`` -> ("optim", "lr", 0.001)."""
    name, sep, value = text.partition("=")
    section, dot, key = name.strip().partition(".")
    if not sep or not dot or not key:
        raise ConfigError(f"--set {text!r}: write section.key=value, e.g. --set optim.lr=1e-3")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()  # a bare word: a string
    return section, key.strip(), parsed


def load_model_config(path: str) -> ModelConfig:
    """The ``[model]`` section of the config file ``path`` alone, for what needs only the model's
    shape (``mpmd export`` of a run's checkpoint, perhaps on another machine): the other
    sections, whose checks look for the training machine's files (``data.train_files``,
    ``tokenizer.path``), are not built, nor is ``model.init_from`` (where the run's weights
    started: a directory of that machine, and no part of the shape)."""
    raw = _read_toml(path)
    sections = {f.name for f in dataclasses.fields(TrainConfig)}
    unknown = sorted(set(raw) - sections)
    if unknown:
        raise ConfigError(f"{path}: unknown section [{unknown[0]}]{_near(unknown[0], sections)}")
    values = raw.get("model", {})
    if isinstance(values, dict):
        values = {k: v for k, v in values.items() if k != "init_from"}
    return _section(path, "model", values)


def _section(source: str, name: str, values: Any):
    """Section ``name`` of a config built from its TOML ``values``, every key checked."""
    if not isinstance(values, dict):
        raise ConfigError(f"{source}: {name} must be a section ([{name}]), got {values!r}")
    cls = _section_class(next(f for f in dataclasses.fields(TrainConfig) if f.name == name))
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise ConfigError(f"{source}: unknown key {name}.{key}{_near(key, fields, prefix=name + '.')}")
        try:
            kwargs[key] = _typed(f"{name}.{key}", value, _hints(cls)[key])
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def config_from_dict(raw: dict, source: str = "the config") -> TrainConfig:
    sections = {f.name: f for f in dataclasses.fields(TrainConfig)}
    built = {}
    for name, values in raw.items():
        if name not in sections:
            raise ConfigError(f"{source}: unknown section [{name}]{_near(name, sections)}")
        built[name] = _section(source, name, values)
    try:
        return TrainConfig(**built)
    except ValueError as e:
        raise ConfigError(f"{source}: {e}") from None


def _near(word: str, valid: Iterable[str], prefix: str = "") -> str:
    valid = list(valid)
    close = difflib.get_close_matches(word, valid, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
    return f"{hint} (valid: {', '.join(prefix + v for v in valid)})"


def _section_class(field: dataclasses.Field) -> type:
    return _hints(TrainConfig)[field.name]


def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _typed(name: str, value: Any, hint: Any) -> Any:
    """``value`` as ``hint`` takes it (an int for a float; a list for a tuple), or a ConfigError."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        if type(None) in args and value is None:
            return None
        for i, member in enumerate(inner):
            try:
                return _typed(name, value, member)
            except ConfigError:
                if i == len(inner) - 1:
                    raise ConfigError(f"{name} must be {' or '.join(_kind(a) for a in inner)}, got {value!r} "
                                      f"({type(value).__name__})") from None
    if origin is tuple:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            raise ConfigError(f"{name} must be a list of {args[0].__name__}, got {value!r}")
        return tuple(_typed(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value))
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, float) and value.is_integer() and abs(value) < 2 ** 53:
        return int(value)  # 1e4 written for 10000
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        raise ConfigError(f"{name} must be {_kind(hint)}, got {value!r} ({type(value).__name__})")
    return value


def _kind(hint: Any) -> str:
    if typing.get_origin(hint) is tuple:
        return f"a list of {_kind(typing.get_args(hint)[0]).removeprefix('an ').removeprefix('a ')}s"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, hint.__name__)


def to_toml(config: TrainConfig) -> str:
    """``config`` as TOML text; ``load_config`` of it gives ``config`` back.  A None value is
    written as a comment (TOML has no null)."""
    lines = []
    for section in dataclasses.fields(config):
        lines.append(f"[{section.name}]")
        for f in dataclasses.fields(getattr(config, section.name)):
            value = getattr(getattr(config, section.name), f.name)
            lines.append(f"# {f.name} = (unset)" if value is None else f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")
