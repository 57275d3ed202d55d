"""Building a stage module from its factory, under the pipeline's seed contract.

Note [stage factories]: ``mpmd.Pipeline(stages=[...])`` takes, per stage, a module or a
zero-argument factory (a callable returning an ``nn.Module``).  A module is pickled on
the controller and shipped; a factory is shipped instead and each actor holding the
stage calls it, so the controller never holds the model.  The seed contract makes that
reproducible: stage ``s``'s factory runs under ``torch.random.fork_rng`` (CPU and every
visible CUDA device) after ``torch.manual_seed(stage_seed(seed, s))``, ``seed`` being
the pipeline's ``seed`` option, and the module is then moved to the actor's device.
So the values depend on the stage index and the seed only: every data-parallel replica
builds the same stage, a restart rebuilds it the same way, the caller's random state is
left as it was (a factory that seeds itself works too), and ``mpmd.build_stages``
(the same ``build_stage``, on the controller) gives bit-identical modules.  The
controller learns a factory stage's structure (keys, shapes, class, ``forward``'s
signature, attributes) from a build on the meta device (``mpmd/runtime/stage_source.py``).

Note [sharded build]: under TP a factory that has ``build_sharded(shard, device)`` is built
without any process holding its whole stage: it makes the stage on the meta device, calls
``shard(stage)`` (the actor's TP plan, which turns the meta weights into meta DTensors),
materialises the shards on ``device`` (``to_empty``) and initialises every tensor in the order
and with the random draws of its unsharded build, a sharded one through
``fill_like_whole`` (one whole tensor in host memory at a time, its box kept).  So each
shard equals the slice of what the unsharded factory would build, bit for bit, and the
actor's peak is its shard plus one tensor.  Other factories and modules are built whole
and sliced (Note [tensor parallelism] in actors/tensor_parallel.py).
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Callable, Optional

import torch

__all__ = ["StageFactory", "stage_seed", "build_stage", "load_stage", "fill_like_whole", "STAGE_SEED_STRIDE"]

STAGE_SEED_STRIDE = 1_000_003  # stage_seed(seed, s) = seed * STAGE_SEED_STRIDE + s


def stage_seed(seed: int, stage: int) -> int:
    """The seed stage ``stage``'s factory is built under (Note [stage factories])."""
    return int(seed) * STAGE_SEED_STRIDE + int(stage)


@dataclasses.dataclass(frozen=True)
class StageFactory:
    """What the controller ships for a stage given as a factory: the factory, pickled on its
    own (stages never share objects of its closure), and the pipeline's seed."""

    factory: bytes
    seed: int


def build_stage(factory: Callable[[], torch.nn.Module], stage: int, seed: int) -> torch.nn.Module:
    """``factory()`` under the seed contract (Note [stage factories]); the caller's random
    state is unchanged.  ``TypeError`` when it returns something else than an ``nn.Module``."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(stage_seed(seed, stage))
        module = factory()
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"stage {stage}'s factory returned a {type(module).__name__}, not an nn.Module; "
                        f"a stage factory takes no arguments and returns the stage's module")
    return module


def load_stage(stage: int, shipped, device: torch.device, rank: int,
               shard: Optional[Callable[[torch.nn.Module], None]] = None) -> torch.nn.Module:
    """Stage ``stage`` on ``device`` from what the controller shipped: a module, the module
    pickled (``bytes``) or a ``StageFactory`` (built here, on actor ``rank``).  ``shard``: the
    stage's TP plan, applied before the stage moves to ``device``, so only shards go there; a
    factory that builds sharded is built so (Note [sharded build])."""
    if isinstance(shipped, StageFactory):
        try:
            factory = pickle.loads(shipped.factory)
            if shard is not None and callable(getattr(factory, "build_sharded", None)):
                return build_stage(lambda: factory.build_sharded(shard, device), stage, shipped.seed)
            module = build_stage(factory, stage, shipped.seed)
        except Exception as e:
            raise RuntimeError(f"building stage {stage} from its factory failed on actor {rank}: "
                               f"{type(e).__name__}: {e}") from e
    else:
        module = pickle.loads(shipped) if isinstance(shipped, bytes) else shipped
    if shard is not None:
        shard(module)  # built whole in host memory; each weight goes to the device as its shard
    return module.to(device)


def fill_like_whole(p: torch.Tensor, init: Callable[[torch.Tensor], None]) -> None:
    """Initialise ``p`` as ``init`` initialises the whole tensor: a DTensor's shard gets its box
    of a whole tensor ``init`` fills in host memory (the same random draws as an unsharded
    build; the peak is that one tensor), a plain tensor is filled in place (Note [sharded build])."""
    from torch.distributed.tensor import DTensor

    if not isinstance(p, DTensor):
        init(p)
        return
    from .pieces import box_slices, local_box

    whole = torch.empty(p.shape, dtype=p.dtype)
    init(whole)
    p.to_local().copy_(whole[box_slices(*local_box(p))])
