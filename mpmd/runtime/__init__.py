"""The controller's runtime: an ``Engine`` runs a pipeline's steps on its ``Fleet`` of actors.

    config.py    PipelineConfig, a group per concern; the stage list and the schedule checked and placed
    limits.py    the limits every configured number is held to (Note [numeric limits])
    engine.py    Engine: issue and complete steps, fusion, programs, state, the step count
    results.py   StepResult (what a step gave back), PendingStep (a step in flight)
    dispatch.py  issuing a step's calls and turning actor failures into errors in seconds
    channels.py  the controller's ends of the step channels (Note [step channel])
    fleet.py     Fleet: the actors and their lifetime: launch, ship modules and programs, restart, teardown
    client.py    ActorClient: every other call to the actors, one typed method each
    cluster.py   connecting to Ray, placing the actors, tearing them down
    pool.py      actors kept between pipelines (mpmd.reuse_actors, Note [reused actors])
    compile.py   lowered schedule -> one program per rank; calls per fusion mode
    batches.py   a step's batch into microbatches and back (the Batching strategy)
    checks.py    input checks and the errors that name the stage at fault
    stage_source.py  stages as modules or factories; build_stages (Note [stage factories])
    state.py     the pipeline's state-dict keys; the check of the ties' TP layouts
"""

from .batches import FED, Batching, MicrobatchSplit
from .client import ActorClient
from .config import (FLAT_OPTIONS, FUSION_MODES, ClusterConfig, CommConfig, DispatchConfig, LayoutConfig, PipelineConfig,
                     PlanningConfig, RecipeConfig, build_schedule, check_microbatches, check_stages)
from .engine import FORWARD, TRAIN, Engine
from .fleet import Fleet
from .pool import ActorPool, reuse_actors
from .results import PendingStep, StepResult
from .stage_source import StageSource, build_stages, resolve_stages, stage_seed

__all__ = ["Engine", "Fleet", "ActorClient", "TRAIN", "FORWARD", "FED", "StepResult", "PendingStep", "PipelineConfig",
           "LayoutConfig", "ClusterConfig", "DispatchConfig", "CommConfig", "RecipeConfig", "PlanningConfig", "FLAT_OPTIONS",
           "FUSION_MODES", "check_microbatches", "Batching", "MicrobatchSplit", "build_schedule",
           "check_stages", "StageSource", "resolve_stages", "build_stages", "stage_seed", "ActorPool", "reuse_actors"]
