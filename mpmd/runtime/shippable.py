"""Stages that cannot be pickled are refused before any actor starts, naming the stage,
the attribute that holds what does not pickle, and the way out.

A stage travels to its actors pickled (``StageSource.shipped``); a module holding, say, a
``threading.Lock`` or an open file failed there with a bare ``TypeError: cannot pickle
'_thread.lock' object``, after the actors had started.  ``check_shippable`` pickles each
stage into a sink that keeps nothing, its tensors' data left out (milliseconds for a
large model, no memory) and, when that fails, walks the object's attributes (a module's submodules, parameters and plain
attributes; dict, list and tuple items; a function's closure, defaults and a partial's
arguments) down to the innermost one that still fails.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator, Optional

import torch
from ray import cloudpickle

__all__ = ["check_shippable", "unpicklable_path"]

_MAX_DEPTH = 12


class _Sink:
    def write(self, data) -> int:
        return len(data)


class _NoTensorData(cloudpickle.CloudPickler):
    """Pickles like the shipping does, but a tensor as an empty one: its data always pickles."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and type(obj) in (torch.Tensor, torch.nn.Parameter):
            return torch.empty, (0,)
        return super().reducer_override(obj)


def _pickle_error(obj: Any) -> Optional[Exception]:
    try:
        _NoTensorData(_Sink()).dump(obj)
    except Exception as e:  # noqa: BLE001 - any failure to pickle is what is looked for
        return e
    return None


def _children(obj: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield f"[{k!r}]", v
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield f"[{i}]", v
    elif isinstance(obj, functools.partial):
        yield ".func", obj.func
        for i, v in enumerate(obj.args):
            yield f".args[{i}]", v
        for k, v in obj.keywords.items():
            yield f".keywords[{k!r}]", v
    elif callable(obj) and hasattr(obj, "__code__"):  # a function: what it carries with it
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or ()):
            try:
                yield f" (its closure variable {name!r})", cell.cell_contents
            except ValueError:  # an empty cell
                continue
        for i, v in enumerate(obj.__defaults__ or ()):
            yield f" (its default argument {i})", v
        for name in obj.__code__.co_names:
            if name in getattr(obj, "__globals__", {}):
                yield f" (the global {name!r} it uses)", obj.__globals__[name]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            if k in ("_modules", "_parameters", "_buffers") and isinstance(v, dict):  # nn.Module's own
                for kk, vv in v.items():
                    yield f".{kk}", vv
            else:
                yield f".{k}", v


def unpicklable_path(obj: Any, path: str = "") -> tuple[str, Any]:
    """The attribute path (from ``obj``) of the innermost value that fails to pickle, and that
    value; ``(path, obj)`` when no part of it fails on its own."""
    for _ in range(_MAX_DEPTH):
        for name, child in _children(obj):
            if _pickle_error(child) is not None:
                obj, path = child, path + name
                break
        else:
            break
    return path, obj


def check_shippable(i: int, stage: Any) -> None:
    """Refuse stage ``i`` (a module or a factory) if it cannot be pickled to its actors."""
    error = _pickle_error(stage)
    if error is None:
        return
    factory = not isinstance(stage, torch.nn.Module)
    path, culprit = unpicklable_path(stage, f"stages[{i}]")
    holder = (f"{path} holds a {type(culprit).__module__}.{type(culprit).__qualname__}" if path != f"stages[{i}]"
              else f"stages[{i}]")
    what = (f"'s factory {getattr(stage, '__qualname__', type(stage).__name__)}" if factory
            else f" ({type(stage).__name__})")
    if factory:
        fix = ("create that object inside the factory (a factory's closure and defaults are pickled with it), "
               "or leave it out")
    else:
        fix = (f"build the stage on its actor instead: pass a zero-argument factory that creates it there "
               f"(e.g. lambda: {type(stage).__name__}(...)), whose objects are never pickled; or drop the attribute "
               f"(create it lazily in forward, or delete it before building the Pipeline)")
    raise ValueError(f"stage {i}{what} cannot be shipped to its actors: {holder}, which cannot "
                     f"be pickled ({type(error).__name__}: {error}); {fix}") from error
