"""Failures inside actors become errors that say where, within seconds; bad
arguments are refused in the constructor before any actor starts."""

from __future__ import annotations

import os
import threading
import time

import pytest
import ray
import torch
from torch import nn
from torch.nn import functional as F

import mpmd
import schedules

from tests.models import Head, adamw, make_data, make_stages

MICROBATCHES = 2
BATCH = 8


class Boom(nn.Module):
    """A stage that raises on a microbatch of 3 samples: batch 6 with 2 microbatches
    triggers it, whichever step that is; batch 8 trains normally."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        if x.shape[0] == 3:
            raise RuntimeError("boom")
        return self.inner(x)


def test_stage_failure_surfaces_with_where_and_tears_down(ray_session):
    stages = make_stages(2)
    stages[1] = Boom(Head(8, 3))
    # The peer of the failing actor blocks in a gloo receive: it must be torn down by the
    # controller, not wait for this timeout.
    comm_timeout_s = 60.0
    pipe = mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                         optimizer=adamw, device="cpu", comm_timeout_s=comm_timeout_s)
    try:
        handles = list(pipe.actors)
        assert len(handles) == 2
        for x, y in make_data(2, BATCH):  # steps 0 and 1 run
            pipe.step(x, y)
        x, y = make_data(1, 6, seed=5)[0]
        start = time.monotonic()
        with pytest.raises(mpmd.StageFailedError) as info:
            pipe.step(x, y)  # step 2
        elapsed = time.monotonic() - start
    finally:
        pipe.shutdown()

    err = info.value
    assert elapsed < comm_timeout_s / 3, f"the failure took {elapsed:.1f}s to surface"
    assert (err.rank, err.stage, err.step, err.instruction) == (1, 1, 2, "1F0")
    message = str(err)
    for part in ("rank 1", "stage 1", "step 2", "1F0", "RuntimeError: boom"):
        assert part in message, f"{part!r} not in the message:\n{message}"
    assert err.actor_traceback and "boom" in err.actor_traceback and "Traceback" in err.actor_traceback
    assert isinstance(err, mpmd.PipelineError) and isinstance(err, RuntimeError)

    # The pipeline's actors are gone, and the pipeline says so.
    assert pipe.actors == []
    for handle in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.pid.remote(), timeout=30)
    with pytest.raises(RuntimeError, match="shut down"):
        pipe.step(*make_data(1, BATCH)[0])
    with pytest.raises(RuntimeError, match="shut down"):
        pipe.state_dict()


def test_a_failure_in_a_step_issued_ahead_surfaces_from_its_result(ray_session):
    stages = make_stages(2)
    stages[1] = Boom(Head(8, 3))
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                       optimizer=adamw, device="cpu", comm_timeout_s=60.0) as pipe:
        good = pipe.step_async(*make_data(1, BATCH)[0])
        bad = pipe.step_async(*make_data(1, 6, seed=5)[0])  # queued behind the good one
        start = time.monotonic()
        assert good.result() > 0
        with pytest.raises(mpmd.StageFailedError) as info:
            bad.result()
        assert time.monotonic() - start < 20
    assert (info.value.step, info.value.instruction) == (1, "1F0")
    assert pipe.actors == []
    with pytest.raises(RuntimeError, match="shut down"):
        pipe.predict(make_data(1, BATCH)[0][0])


# -- refused before any actor starts ---------------------------------------------------------------


@pytest.fixture
def no_actors(monkeypatch):
    """Fail loudly if the constructor gets as far as Ray or the actors."""

    def started(*args, **kwargs):
        raise AssertionError("the Pipeline connected to Ray / started actors before refusing")

    monkeypatch.setattr("mpmd.runtime.cluster.connect", started)
    monkeypatch.setattr("mpmd.runtime.cluster.create_actors", started)


def refused(stages, match: str, **kwargs) -> None:
    kwargs = {"num_microbatches": 4, "loss_fn": F.mse_loss, "optimizer": adamw, "device": "cpu", **kwargs}
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        mpmd.Pipeline(stages, **kwargs)
    assert time.monotonic() - start < 5.0


def test_refuses_stages_that_are_not_modules(no_actors):
    refused([nn.Linear(2, 2), "relu", nn.Linear(2, 2)], r"stages\[1\] is a str, not an nn\.Module")
    # A class is a factory (Note [stage factories]): nn.ReLU would build; one that needs arguments is refused.
    refused([nn.ReLU, nn.Linear], r"stages\[1\] is a factory that takes arguments \(in_features, out_features\)")
    refused(nn.Linear(2, 2), r"stages must be a list of nn\.Module.*mpmd\.split")


class Locked(nn.Module):
    """A stage holding a lock (as caching code does): it cannot be pickled to its actor."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 3))
        self.body[0].cache = {"lock": threading.Lock()}

    def forward(self, x):
        return self.body(x)


def _factory_closing_over_a_lock():
    lock = threading.Lock()

    def build() -> nn.Module:  # a closure: pickled by value, with the lock
        with lock:
            return nn.Linear(6, 3)
    return build


def test_refuses_a_stage_that_cannot_be_pickled_naming_the_attribute(no_actors):
    refused([nn.Linear(6, 6), Locked()], r"stage 1 \(Locked\) cannot be shipped to its actors: "
            r"stages\[1\]\.body\.0\.cache\['lock'\] holds a _thread\.lock, which cannot be pickled "
            r"\(TypeError: cannot pickle '_thread\.lock' object\); build the stage on its actor instead: pass a "
            r"zero-argument factory .*lambda: Locked\(\.\.\.\).*or drop the attribute")
    refused([nn.Linear(6, 6), _factory_closing_over_a_lock()], r"stage 1's factory .*build cannot be shipped to its "
            r"actors: stages\[1\] \(its closure variable 'lock'\) holds a _thread\.lock.*create that object inside "
            r"the factory")


def test_refuses_empty_stages(no_actors):
    refused([], "stages is empty")
    refused(iter([]), "stages is empty")


def test_refuses_a_schedule_that_needs_more_stages(no_actors):
    refused(make_stages(3), r"interleaved-1f1b puts 2 stages on each actor, but 3 stages were given",
            schedule="interleaved-1f1b")
    refused(make_stages(2), r"zbv on 2 actors needs 4 stages, but 2 were given", schedule="zbv", num_actors=2)
    refused(make_stages(4), r"1f1b on 2 actors needs 2 stages, but 4 were given", schedule="1f1b", num_actors=2)


def test_refuses_too_few_microbatches_for_the_schedule(no_actors):
    refused(make_stages(4), r"num_microbatches \(3\) must be divisible by num_ranks \(2\)",
            schedule="interleaved-1f1b", num_microbatches=3)
    refused(make_stages(3), r"zb-h2 needs num_microbatches >= 2\*num_ranks - 1 = 5", schedule="zb-h2")
    refused(make_stages(4), r"dualpipev needs num_microbatches >= 2\*num_ranks = 4 for 2 ranks, got 2",
            schedule="dualpipev", num_microbatches=2)


def test_refuses_unknown_fusion_mode(no_actors):
    refused(make_stages(2), r"unknown fusion mode 'fast'; use one of step, consecutive, none", fusion="fast")


def test_refuses_unknown_schedule_name(no_actors):
    refused(make_stages(2), r"unknown schedule 'pipedream'; registered schedules: .*1f1b", schedule="pipedream")
    refused(make_stages(2), r"schedule must be a name", schedule=3)


def test_refuses_num_actors_not_dividing_stages(no_actors):
    refused(make_stages(4), r"4 stages do not divide over num_actors=3", schedule="interleaved-1f1b",
            num_actors=3)
    refused(make_stages(4), r"num_actors must be a positive integer", num_actors=0)


def test_refuses_a_schedule_object_for_other_stage_counts(no_actors):
    two_stages = schedules.get_schedule("1f1b", num_ranks=2, num_microbatches=4)
    refused(make_stages(4), r"the schedule has 2 stages but 4 stage modules were given", schedule=two_stages)
    refused(make_stages(2), r"the schedule is for 4 microbatches but num_microbatches=2", schedule=two_stages,
            num_microbatches=2)


def test_refuses_bad_options(no_actors):
    refused(make_stages(2), r"num_microbatches must be a positive integer", num_microbatches=0)
    refused(make_stages(2), r"loss_fn must be callable", loss_fn="mse")
    refused(make_stages(2), r"optimizer must be a factory", optimizer=torch.optim.AdamW([torch.zeros(1,
                                                                                        requires_grad=True)]))
    refused(make_stages(2), r"device must be 'auto', 'cpu' or 'cuda'", device="tpu")
    refused(make_stages(2), r"dp must be a positive integer", dp=0)


def test_refuses_a_buffer_shared_across_stages(no_actors):
    # Each stage gets its own copy; copies of a buffer a module updates would drift apart.
    norm = nn.BatchNorm1d(6)
    refused([nn.Sequential(nn.Linear(6, 6), norm), nn.Sequential(norm, nn.Linear(6, 3))],
            r"stage 0 \('1.running_mean'\) and stage 1 \('0.running_mean'\) share one buffer.*copy.deepcopy")


def test_a_valid_configuration_passes_the_guard(no_actors):
    # The guard itself: a valid pipeline reaches Ray, which the fixture turns into an error.
    with pytest.raises(AssertionError, match="started actors"):
        mpmd.Pipeline(make_stages(2), num_microbatches=2, loss_fn=F.mse_loss, optimizer=adamw, device="cpu")


class DiesWhenShipped(nn.Module):
    """A stage whose unpickling inside an actor kills that actor's process (as a
    module needing a missing library or too much memory would)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.controller_pid = os.getpid()

    def forward(self, x):
        return self.inner(x)

    def __setstate__(self, state):
        if state["controller_pid"] != os.getpid():
            os._exit(1)


def test_actor_dying_while_modules_are_shipped_names_its_rank(ray_session):
    stages = make_stages(2)
    stages[1] = DiesWhenShipped(stages[1])
    start = time.monotonic()
    with pytest.raises(mpmd.ActorDiedError) as info:
        mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=F.mse_loss,
                      optimizer=adamw, device="cpu", comm_timeout_s=60.0)
    assert time.monotonic() - start < 60.0
    err = info.value
    assert "died during shipping modules and programs" in str(err)
    assert (err.rank, err.stages) == (1, (1,)), str(err)
