"""``ActorClient``: every call the controller makes to its actors outside a step, one typed
method each.

A step's calls go through the ``Dispatcher`` and the fleet's own set-up calls through the
``Fleet``; everything else the features ask the actors (state dicts, checkpoint shards,
export and import, data feeds, RNG states, memory and clock probes, fill jobs) goes through
here, so that no module outside the runtime names an actor method or holds a Ray call to a
stage actor.  Every checked call first makes sure the pipeline is open and waits until the
steps issued before it have finished on the actors (Note [calls between steps]).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import ray

from actors.expert_state import whole_state

from .fleet import Fleet

__all__ = ["ActorClient"]


# Note [calls between steps]: an actor serves the step channel and Ray calls from two threads,
# so a Ray call issued while a step is still in flight could run beside it (a checkpoint of
# half a step, an export of weights mid-update).  Every call here therefore waits until the
# steps issued before it have finished (``Fleet.quiesce``; their results are kept), after
# checking that the pipeline is open: a call on a shut-down pipeline fails with the same
# message everywhere.  The exceptions say why they skip it: a fill job's outputs are taken in
# order behind the steps on purpose, and an asynchronous save's progress is polled from its
# own thread while steps run.
class ActorClient:
    """Typed calls to ``fleet``'s actors (see the module docstring)."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet

    def _call(self, call: Callable[[Any], Any], what: str, indices: Optional[Sequence[int]] = None) -> list:
        """``call(actor)`` on the actors ``indices`` (default: all), after the steps in flight
        (Note [calls between steps]); their results in that order."""
        return self._call_each({i: call for i in self._indices(indices)}, what)

    def _call_each(self, calls: dict[int, Callable[[Any], Any]], what: str) -> list:
        """``calls[i](actor i)`` for each ``i``, after the steps in flight; results in ``calls``' order."""
        fleet = self._fleet
        fleet.check_open()
        fleet.quiesce()
        futures = {call(fleet.actors[i]): i for i, call in calls.items()}
        return fleet.wait(list(futures), what, owner=futures)

    def _indices(self, indices: Optional[Sequence[int]]) -> Sequence[int]:
        return range(len(self._fleet.actors)) if indices is None else indices

    # -- state dicts -------------------------------------------------------------------------------
    def state_dicts(self, indices: Optional[Sequence[int]] = None) -> list[dict]:
        """Each actor's ``{stage: state dict}`` (whole tensors: under TP gathered by the group)."""
        return self._call(lambda a: a.state_dict.remote(), "state_dict", indices)

    def stage_states(self) -> dict:
        """``{stage: state dict}`` from the first replica (Note [tensor parallelism]: every actor
        of a TP group takes part in the gathering; TP rank 0's answer is kept), its experts
        assembled from the pieces of EP group 0's members (Note [expert parallelism] in
        actors/grid.py; Note [expert pieces] in actors/expert_state.py)."""
        grid = self._fleet.grid
        if grid.ep == 1:
            return self._first_replica(self.state_dicts)
        asked = [(e, grid.ep_member(e, r)) for e in range(grid.ep) for r in range(grid.pp)]  # EP group 0
        answers = self.state_dicts([i for _, i in asked])
        parts = [{} for _ in range(grid.ep)]
        for (e, _), part in zip(asked, answers):
            parts[e].update(part)
        return whole_state(parts)

    def stage_shapes(self) -> dict:
        """``{stage: {name: shape}}`` from the first replica; no tensor moves."""
        return self._first_replica(lambda indices: self._call(lambda a: a.state_shapes.remote(), "state_shapes",
                                                              indices))

    def _first_replica(self, ask: Callable[[list], list]) -> dict:
        grid = self._fleet.grid
        indices = [grid.actor(0, r, t) for r in range(grid.pp) for t in range(grid.tp)]  # CP rank 0: CP shards no parameter
        return {s: st for i, part in zip(indices, ask(indices)) if grid.coord(i).tp == 0 for s, st in part.items()}

    def load_stage_states(self, parts: dict[int, dict]) -> None:
        """Send each actor its stages' parts of ``{stage: state dict}``: each stage's part goes
        into Ray's object store once, whichever replicas and TP ranks read it."""
        fleet = self._fleet
        refs = {s: ray.put(part) for s, part in parts.items()}
        stages = {i: list(fleet.schedule.stages_of(fleet.rank_of(i))) for i in range(len(fleet.actors))}
        self._call_each({i: lambda a, mine=mine: a.load_state_dict.remote(mine, *[refs[s] for s in mine])
                         for i, mine in stages.items()}, "load_state_dict")

    def checkpoint_states(self, indices: Optional[Sequence[int]] = None, what: str = "reading the state") -> list[dict]:
        """Each actor's ``{stage: module, optimizer and scheduler state}``."""
        return self._call(lambda a: a.checkpoint_state.remote(), what, indices)

    def load_checkpoint_states(self, states: Any, indices: Sequence[int], what: str) -> None:
        """``states`` (``{stage: checkpoint_state's}``, or a Ray reference to it) into the actors ``indices``."""
        self._call(lambda a: a.load_checkpoint_state.remote(states), what, indices)

    # -- RNG states --------------------------------------------------------------------------------
    def rng_states(self, what: str = "the actors' RNG states") -> list:
        """Every actor's RNG states, in actor order, for ``set_rng_states``."""
        return self._call(lambda a: a.rng_state.remote(), what)

    def set_rng_states(self, states: Sequence, what: str = "putting the RNG states back") -> None:
        """Put back the actors' RNG states ``rng_states`` returned (one per actor, in order)."""
        self._call_each({i: lambda a, s=s: a.set_rng_state.remote(s) for i, s in enumerate(states)}, what)

    # -- checkpoint shards -------------------------------------------------------------------------
    def save_shards(self, directory: str, blocking: bool, what: str) -> list[tuple]:
        """Each actor writes its shard into ``directory`` (or, not ``blocking``, copies its state
        and writes it on its own thread); each actor's report."""
        return self._call(lambda a: a.save_shard.remote(directory, blocking), what)

    def read_shards(self, directory: str, same_layout: bool, what: str) -> list[tuple]:
        """Each actor reads its part of the checkpoint in ``directory`` (its RNG states too when
        ``same_layout``) and holds it until ``apply_shards``; each actor's report."""
        return self._call(lambda a: a.read_shard.remote(directory, same_layout), what)

    def apply_shards(self, apply: bool, what: str) -> None:
        """Install (``apply``) or drop what ``read_shards`` read."""
        self._call(lambda a: a.apply_shard.remote(apply), what)

    @staticmethod
    def shard_status(actor: Any) -> Any:
        """A Ray reference to ``actor``'s progress writing its shard.  Unchecked (Note [calls
        between steps]): an asynchronous save polls it from its own thread, on the actors that
        took the save, while steps run."""
        return actor.shard_status.remote()

    # -- export and import -------------------------------------------------------------------------
    def export_stages(self, files: dict[int, tuple[str, dict, dict]], dtype: Optional[str]) -> list[dict]:
        """Actor ``i`` writes ``files[i] = (path, {stage: {name: key}}, its expert tensors' slices)``
        as safetensors; each file's ``{key: bytes}``, in ``files``' order."""
        return self._call_each({i: lambda a, p=path, n=names, x=experts: a.export_stage.remote(p, n, dtype, x)
                                for i, (path, names, experts) in files.items()}, "export_stage")

    def expert_slices(self, names: dict[int, dict]) -> list[dict]:
        """Actor ``i``'s slices of the expert tensors among ``names[i]`` (stage -> keys), as Ray
        references, in ``names``' order (Note [export from the actors] in mpmd/training/export.py)."""
        return self._call_each({i: lambda a, n=n: a.expert_slices.remote(n) for i, n in names.items()},
                               "expert_slices")

    def import_stages(self, directory: str, names: dict[int, dict], weight_map: dict) -> None:
        """Every actor copies its stages' tensors (``names[stage]``: ``{name: key}``) from the
        safetensors files in ``directory``."""
        fleet = self._fleet
        mine = {i: {s: names[s] for s in fleet.schedule.stages_of(fleet.rank_of(i))} for i in range(len(fleet.actors))}
        self._call_each({i: lambda a, n=n: a.import_stage.remote(directory, n, weight_map) for i, n in mine.items()},
                        "import_stage")

    # -- data feeds --------------------------------------------------------------------------------
    def attach_feeds(self, feeds: dict[int, Any], what: str) -> None:
        """Actor ``i`` pulls its steps' data from ``feeds[i]`` (Note [fed steps] in actors/feed.py)."""
        self._call_each({i: lambda a, f=f: a.attach_feed.remote(f) for i, f in feeds.items()}, what)

    def detach_feeds(self, indices: Sequence[int], what: str) -> None:
        self._call(lambda a: a.attach_feed.remote(None), what, indices)

    # -- probes ------------------------------------------------------------------------------------
    def memory_stats(self, *, reset: bool = False, indices: Optional[Sequence[int]] = None,
                     what: str = "memory_stats") -> list[dict]:
        """Each actor's allocator statistics (peaks since the last ``reset``)."""
        return self._call(lambda a: a.memory_stats.remote(reset=reset), what, indices)

    def memory_bytes(self, what: str = "memory_bytes") -> list[dict]:
        """Each actor's bytes held by parameters, gradients and optimizer state."""
        return self._call(lambda a: a.memory_bytes.remote(), what)

    def rss_bytes(self, what: str = "rss_bytes") -> list[int]:
        return self._call(lambda a: a.rss_bytes.remote(), what)

    def free_memory_bytes(self, what: str = "reading free memory") -> list[int]:
        return self._call(lambda a: a.free_memory_bytes.remote(), what)

    def sent_bytes(self, program: str) -> list[dict]:
        """Per actor, ``{stage: bytes of its output as last sent}`` in ``program``."""
        return self._call(lambda a: a.sent_bytes.remote(program), "message sizes")

    def probe_links(self, pairs: list, sizes: list, repeats: int, indices: Sequence[int]) -> list:
        return self._call(lambda a: a.probe_links.remote(pairs, sizes, repeats), "link probe", indices)

    def clock_ns(self, index: int) -> int:
        return self._call(lambda a: a.clock_ns.remote(), "clock probe", [index])[0]

    def node_ids(self) -> list[str]:
        """The Ray node of each actor, in actor order."""
        return self._call(lambda a: a.node_id.remote(), "node ids")

    def run_in_each(self, fn: Callable[[Any], Any], what: str) -> list:
        """``fn(worker)`` inside every actor (benchmarks reading an actor's internals)."""
        return self._call(lambda a: a.__ray_call__.remote(fn), what)

    # -- fill jobs ---------------------------------------------------------------------------------
    def register_fill_job(self, job_id: int, fn: Callable, collate: bool, data: Any) -> None:
        self._call(lambda a: a.register_fill_job.remote(job_id, fn, collate, data), "registering fill jobs")

    def drop_fill_jobs(self, job_ids: list) -> None:
        self._call(lambda a: a.drop_fill_jobs.remote(job_ids), "releasing finished fill jobs")

    def take_fill_outputs(self) -> list:
        """Ask every actor for its fill outputs after the calls already issued to it, without
        waiting (over the step channel where open; Note [fetching fill outputs]); ``result_of``
        gets each one's."""
        dispatch = self._fleet.dispatch
        return [dispatch.call(i, "take_fill_outputs") for i in range(len(self._fleet.actors))]

    def result_of(self, handle: Any, timeout_s: float) -> Any:
        return self._fleet.dispatch.get(handle, timeout_s)
