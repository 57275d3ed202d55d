"""The stages as the user gave them: per stage a module, or a zero-argument factory that the
actors holding the stage call (Note [stage factories] in actors/build.py).

``resolve_stages`` checks the list and learns each factory stage's structure (state-dict
keys and shapes, class, ``forward``'s signature, attributes such as ``keeps_model_keys``)
by building it on the meta device: no memory, and nothing of the model stays on the
controller.  A factory that cannot build there is built once for real (one stage at a
time, under the seed contract) and only its structure kept.  The controller's features
read ``StageSource.modules`` for structure only; measuring (``schedule="auto"``) builds
real copies one stage at a time with ``StageSource.build``.

Tied parameters: stages built by separate factory calls share nothing, so a factory stage
cannot be tied to another stage.  A factory that returns tensors living outside the call
(a module it closes over) would be pickled with it and become a separate copy per stage;
when two stages would share one that way, ``resolve_stages`` refuses.
"""

from __future__ import annotations

import copy
import gc
import inspect
import itertools
import weakref
from typing import Callable, Sequence, Union

import torch
from ray import cloudpickle

from actors.build import StageFactory, build_stage, stage_seed

from .checks import warn_user
from .shippable import check_shippable
from .ties import find_ties

__all__ = ["StageSource", "resolve_stages", "build_stages", "stage_seed"]

Stages = Union[Sequence[Union[torch.nn.Module, Callable[[], torch.nn.Module]]], "StageSource"]


class StageSource:
    """The pipeline's stages: ``modules`` per stage the given module, or a factory stage's
    structure on the meta device; ``factories`` the factory stages; ``seed`` the pipeline's."""

    def __init__(self, modules: Sequence[torch.nn.Module], factories: dict[int, Callable], seed: int) -> None:
        self.modules = tuple(modules)
        self.factories = dict(factories)
        self.seed = seed
        self._pickled = {s: cloudpickle.dumps(f) for s, f in self.factories.items()}

    def __len__(self) -> int:
        return len(self.modules)

    @property
    def has_factories(self) -> bool:
        return bool(self.factories)

    def shipped(self, s: int) -> Union[bytes, StageFactory]:
        """What the actors holding stage ``s`` get: the module pickled on its own (stages sharing
        a parameter get a copy each, Note [tie reduction]) or the factory with the seed."""
        if s in self._pickled:
            return StageFactory(self._pickled[s], self.seed)
        return cloudpickle.dumps(self.modules[s])

    def build(self, s: int, device: Union[str, torch.device] = "cpu") -> torch.nn.Module:
        """A real copy of stage ``s`` on ``device`` (for measuring on the controller): a copy of
        the given module, or the factory's stage built under the seed contract."""
        if s in self.factories:
            return build_stage(self.factories[s], s, self.seed).to(device)
        return copy.deepcopy(self.modules[s]).to(device)


def build_stages(stages: Sequence[Union[torch.nn.Module, Callable[[], torch.nn.Module]]],
                 seed: int = 0) -> list[torch.nn.Module]:
    """Build stage factories here, eagerly, exactly as a ``Pipeline(stages, seed=seed)``'s actors
    build them (Note [stage factories]): stage ``s``'s factory runs after
    ``torch.manual_seed(stage_seed(seed, s))`` under a fork of the random state.  Modules in
    the list are kept as they are.  For comparisons and single-process references: it
    holds the whole model here."""
    source = resolve_stages(stages, seed)
    return [source.build(s) if s in source.factories else m for s, m in enumerate(source.modules)]


def resolve_stages(stages: Stages, seed: int = 0) -> StageSource:
    """Check the stage list (modules and/or zero-argument factories, mixed freely) and learn
    the factory stages' structure; a ``ValueError`` names the stage and the fix."""
    if isinstance(stages, StageSource):
        return stages
    if isinstance(stages, torch.nn.Module) and not isinstance(stages, (torch.nn.Sequential, torch.nn.ModuleList)):
        raise ValueError("stages must be a list of nn.Module, one per pipeline stage; "
                         "to cut one model into stages use mpmd.split(model, num_stages=...)")
    if callable(stages) and not isinstance(stages, torch.nn.Module):
        raise ValueError("stages must be a list, one entry per pipeline stage (a module or a factory); "
                         "got one callable: pass [factory_0, factory_1, ...]")
    stages = list(stages)
    if not stages:
        raise ValueError("stages is empty: pass a list of nn.Module (or factories), one per pipeline stage")
    modules, factories, outside = [], {}, {}
    for i, s in enumerate(stages):
        if isinstance(s, torch.nn.Module):
            check_shippable(i, s)  # refused before any actor starts
            modules.append(s)
        elif callable(s):
            _check_signature(i, s)
            check_shippable(i, s)
            structure, outside[i] = _structure(i, s, seed)
            modules.append(structure)
            factories[i] = s
        else:
            raise ValueError(f"stages[{i}] is a {type(s).__name__}, not an nn.Module or a zero-argument factory; "
                             f"pass, per pipeline stage, a module or a function that builds it "
                             f"(e.g. lambda: MyStage(...))")
    _refuse_shared(stages, outside)
    for tie in find_ties(modules):  # the same structure returned for two stages
        if any(s in factories for s in tie.stages):
            _refuse_tie(tie.stages[0], tie.stages[1], next(s for s in tie.stages if s in factories))
    return StageSource(modules, factories, seed)


def _check_signature(i: int, factory: Callable) -> None:
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):  # no signature to read: find out when it is called
        return
    needed = [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if needed:
        raise ValueError(f"stages[{i}] is a factory that takes arguments ({', '.join(needed)}); the runtime calls "
                         f"each stage factory with none: bind them, e.g. functools.partial(f, ...) or "
                         f"lambda: f(...)")


def _structure(i: int, factory: Callable, seed: int) -> tuple[torch.nn.Module, list[torch.Tensor]]:
    """Stage ``i``'s structure on the meta device, and the tensors its factory returned that
    live outside the call (Note [stage factories])."""
    try:
        with torch.random.fork_rng(devices=[]), torch.device("meta"):
            built = factory()
    except Exception as meta_error:  # noqa: BLE001 - e.g. it reads a value: build it for real, once
        try:
            built = build_stage(factory, i, seed)
        except Exception as e:
            raise ValueError(f"stages[{i}]'s factory raised on the controller (it is called there on the meta "
                             f"device to learn the stage's structure): {type(e).__name__}: {e}; fix the factory, "
                             f"or pass the built module") from e
        warn_user(f"stages[{i}]'s factory cannot build on the meta device ({type(meta_error).__name__}: "
                  f"{meta_error}); the controller built it once for real to learn its structure and freed it")
    if not isinstance(built, torch.nn.Module):
        raise ValueError(f"stages[{i}]'s factory returned a {type(built).__name__}, not an nn.Module; a stage "
                         f"factory takes no arguments and returns the stage's module")
    tensors = _tensors(built)
    if all(t.is_meta for t in tensors):
        return built, []
    refs = [weakref.ref(t) for t in tensors]
    structure = _meta_copy(built, tensors)
    del built, tensors
    if any(r() is not None for r in refs):
        gc.collect()  # a module in a reference cycle
    outside = list({id(t): t for r in refs if (t := r()) is not None}.values())
    if outside:
        warn_user(f"stages[{i}]'s factory returned {len(outside)} tensors that exist outside the call (e.g. a "
                  f"module the factory closes over): they are pickled with the factory, so the controller "
                  f"holds them, and each stage gets its own copy; create them inside the factory")
    return structure, outside


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module``, shared ones as often as they appear."""
    return [t for _, t in itertools.chain(module.named_parameters(remove_duplicate=False),
                                          module.named_buffers(remove_duplicate=False))]


def _meta_copy(module: torch.nn.Module, tensors: list[torch.Tensor]) -> torch.nn.Module:
    """``module`` with every parameter and buffer replaced by an empty one on the meta device
    (shared ones stay shared); ``module`` itself is left as it is."""
    memo: dict = {}
    for t in tensors:
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _refuse_shared(stages: list, outside: dict[int, list[torch.Tensor]]) -> None:
    """A tensor a factory returned from outside the call that another stage also holds would be
    trained as separate copies: refuse (Note [stage factories])."""
    holders: dict[int, list[int]] = {}
    for s, entry in enumerate(stages):
        held = outside[s] if s in outside else _tensors(entry)
        for t in {id(t): t for t in held}:
            holders.setdefault(t, []).append(s)
    for ids in holders.values():
        if len(ids) > 1 and any(s in outside for s in ids):
            _refuse_tie(ids[0], ids[1], next(s for s in ids if s in outside))


def _refuse_tie(a: int, b: int, factory: int) -> None:
    raise ValueError(
        f"stages {a} and {b} share a parameter or buffer, and stage {factory} is a factory; each actor builds a "
        f"factory's stage on its own, so they would train as separate copies. Pass built modules (not factories) "
        f"for stages that share parameters (the runtime ties them), or create the shared module inside one stage")
