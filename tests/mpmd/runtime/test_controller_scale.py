"""One controller, many actors: the step channels' controller end (``Channels`` under a
``Dispatcher``) driving more actors than ``select`` can watch (file descriptors past 1,023),
and an actor dying mid-step among them.  The actors are simulated (Note [simulated actors]
in benchmarks/sim_actors.py): the real handshake and frames, no Ray, no torch work."""

from __future__ import annotations

import os
import resource

import pytest

from actors.grid import DeviceGrid
from actors.protocol import StepReply
from benchmarks.sim_actors import SimHelpers, losses_per_actor, nofile_hard_limit, raise_nofile, sim_losses
from mpmd.errors import ActorDiedError
from mpmd.runtime.channels import Channels
from mpmd.runtime.dispatch import Dispatcher
from schedules import get_schedule

PP, MICROBATCHES = 4, 4
SELECT_LIMIT = 1024  # FD_SETSIZE: select() refuses a descriptor at or above it


@pytest.fixture(scope="module")
def helpers():
    with SimHelpers(1) as h:  # one process: its start (it imports torch) is most of this file's time
        yield h


def simulated_pipeline(helpers: SimHelpers, dp: int, *, die_at=None):
    """``(sim, dispatcher, failures)``: ``PP x dp`` simulated actors behind a Dispatcher whose
    channels are open; ``failures`` counts its ``on_failure`` calls."""
    grid = DeviceGrid(dp=dp, pp=PP, tp=1)
    schedule = get_schedule("1f1b", PP, MICROBATCHES)
    key = Channels.new_key()
    sim = helpers.open(losses_per_actor(grid, schedule, MICROBATCHES), key, die_at=die_at)
    failures = []
    dispatcher = Dispatcher(sim.handles, schedule, grid, on_failure=lambda: failures.append(1))
    try:
        dispatcher.attach(Channels(sim.addresses, key))
    except BaseException:
        sim.close()
        raise
    return sim, dispatcher, failures


def issue(dispatcher: Dispatcher, step: int):
    """A fed step over the channels, as fit issues it (no data from the controller)."""
    return dispatcher.issue_step("train", step, None, None, relearn=False, segments=[[(0, -1)]] * PP)


def expected(dispatcher: Dispatcher, step: int) -> list[StepReply]:
    last = dispatcher.schedule.stage_to_rank[-1]
    return [StepReply(losses=sim_losses(i, step, MICROBATCHES if dispatcher.grid.rank_of(i) == last else 0),
                      timeline=[]) for i in range(dispatcher.grid.size)]


def test_more_actors_than_select_can_watch_all_reply_every_step(helpers):
    dp = 275  # 1,100 actors: their sockets take descriptors past FD_SETSIZE
    raise_nofile(PP * dp + 512, "this test's controller")
    sim, dispatcher, failures = simulated_pipeline(helpers, dp)
    try:
        assert len(os.listdir("/proc/self/fd")) > SELECT_LIMIT  # so some channel's descriptor is past 1,023
        pending = issue(dispatcher, 0)
        for step in range(1, 6):
            ahead = issue(dispatcher, step)  # one step out ahead, as fit issues them
            assert dispatcher.finish_step(pending, timeout_s=60) == expected(dispatcher, step - 1)
            pending = ahead
        assert dispatcher.finish_step(pending, timeout_s=60) == expected(dispatcher, 5)
        assert dispatcher.last.rpcs == dispatcher.last.bare == PP * dp  # one shared call a step (Note [bare calls])
        assert not failures
    finally:
        dispatcher.close()
        sim.close()


def test_an_actor_that_closes_its_socket_mid_step_is_reported_dead_by_name(helpers):
    dying = DeviceGrid(dp=2, pp=PP, tp=1).actor(replica=1, rank=2)
    sim, dispatcher, failures = simulated_pipeline(helpers, 2, die_at={dying: 2})
    try:
        first, second = issue(dispatcher, 0), issue(dispatcher, 1)
        assert dispatcher.finish_step(first, timeout_s=30) == expected(dispatcher, 0)
        third = issue(dispatcher, 2)
        assert dispatcher.finish_step(second, timeout_s=30) == expected(dispatcher, 1)
        # A hang would end in PipelineTimeoutError after 30 s; the closed socket is seen at once.
        with pytest.raises(ActorDiedError, match=r"the actor of rank 2 \(replica 1, stages \[2\]\) died during "
                                                 r"step 2") as e:
            dispatcher.finish_step(third, timeout_s=30)
        assert (e.value.rank, e.value.stages, e.value.step) == (2, (2,), 2)
        assert failures == [1]  # the pipeline was torn down once
    finally:
        dispatcher.close()
        sim.close()


def test_a_descriptor_limit_too_low_is_named_with_how_to_raise_it():
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open descriptors here")
    with pytest.raises(OSError, match=r"needs .* open descriptors but the hard limit \(ulimit -Hn\) is .*; raise it"):
        raise_nofile(nofile_hard_limit() + 1, "this test")


@pytest.mark.parametrize("argv, message", [
    (["--sizes", "10"], r"--sizes must be multiples of pp=4 \(got \[10\]\)"),
    (["--ray-sizes", "0"], r"--ray-sizes, .* must be positive"),
    (["--steps", "0"], r"--steps and --ray-steps must be positive"),
])
def test_bench_controller_refuses_bad_options_before_starting_anything(argv, message):
    from mpmd.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["bench", "controller", *argv])


def test_sim_helpers_refuse_what_they_cannot_serve(helpers):
    with pytest.raises(ValueError, match="processes must be a positive integer, got 0"):
        SimHelpers(0)
    with pytest.raises(ValueError, match="needs at least one actor"):
        helpers.open([], Channels.new_key())
