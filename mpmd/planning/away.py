"""Measuring the stages for ``schedule="auto"`` where the actors will run, not on the controller.

Note [measured where it runs]
-----------------------------
``plan_pipeline`` times every stage at every candidate microbatch size and reads what each
holds.  Done on the controller, a GPU run measured whole stages on the controller's own
GPU: the CUDA context and the caching allocator's peak stayed reserved there for the rest
of the run (an actor later placed on that GPU inherited it), the controller needed a GPU
at all (on a cluster it often has none), and nothing released it.  So on ``device="cuda"``
(and wherever ``measure_away`` is asked for) the measurement runs in a Ray task that asks
for what one actor asks for (its GPU share and CPUs), under the run's precision (the
actors' autocast and the bf16 boundary, Note [precision boundary] in
actors/stage_exec.py), and the task's process exits when it returns (``max_calls=1``), so
its device memory goes back to the GPU: the controller allocates nothing on a CUDA device.
Factory stages are built in the task one at a time, as the controller built them (Note
[stage factories]); given modules travel there pickled.  The measurements come back
without the stage outputs they chained through (``Measurement.output``), with the memory
limit of the device the task ran on.  On CPU the controller measures as before, with the
actor's thread count (``num_cpus``): it is the same kind of core, and a Ray task would add
a process start to every ``auto``.

Not done here: stages are measured whole, unsharded, even when ``tp > 1`` (the TP cost
model scales them, Note [TP cost model] in tp.py); one task measures every stage in turn,
so it must hold the largest stage (with factories, one at a time).  The trials on the
actors (Note [calibrated auto] in replan.py) then correct the times from what the actors,
sharded, measure.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

from ..runtime.devices import Placement
from ..runtime.stage_source import StageSource
from .measure import Measurement, default_memory_limit, measure_built_stages, measure_stages_each

__all__ = ["measure_away", "measure_here"]


def measure_here(stages: Any, samples: Sequence[tuple[Any, Any]], *, loss_fn: Optional[Callable], repeats: int,
                 device: str, threads: int, autocast: Optional[tuple]) -> list[list[Measurement]]:
    """Per sample, every stage's ``Measurement`` in this process (factory stages one at a time)."""
    if isinstance(stages, StageSource) and stages.has_factories:  # one stage at a time (Note [stage factories])
        return measure_built_stages(stages.build, len(stages), [x for x, _ in samples],
                                    targets=[y for _, y in samples], loss_fn=loss_fn, repeats=repeats,
                                    device=device, threads=threads, autocast=autocast)
    modules = stages.modules if isinstance(stages, StageSource) else stages
    return measure_stages_each(modules, samples, loss_fn=loss_fn, repeats=repeats, device=device, threads=threads,
                               autocast=autocast)


def measure_away(stages: Any, samples: Sequence[tuple[Any, Any]], *, loss_fn: Optional[Callable], repeats: int,
                 placement: Placement, threads: int, autocast: Optional[tuple], address: Optional[str],
                 actors: int) -> tuple[list[list[Measurement]], int]:
    """``measure_here`` in a Ray task placed as one actor is (Note [measured where it runs]); and
    the total memory of the device it ran on.  Starts Ray (or attaches to ``address``) if this
    process has not, and stops it again after, so the Pipeline starts it as usual."""
    import ray

    from ..runtime import cluster

    started = cluster.connect(address, actors, threads)
    try:
        task = ray.remote(num_cpus=threads, num_gpus=placement.num_gpus, max_calls=1, max_retries=0)(_measure)
        return ray.get(task.remote(stages, list(samples), loss_fn, repeats, placement.device, threads, autocast))
    finally:
        if started:
            ray.shutdown()


def _measure(stages, samples, loss_fn, repeats, device, threads, autocast) -> tuple[list[list[Measurement]], int]:
    """The task: measure, drop the chained outputs, read the device's memory."""
    per_size = measure_here(stages, samples, loss_fn=loss_fn, repeats=repeats, device=device, threads=threads,
                            autocast=autocast)
    return [[dataclasses.replace(m, output=None) for m in ms] for ms in per_size], default_memory_limit(device)
