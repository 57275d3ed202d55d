"""The profile's all-to-alls hidden behind compute (Note [hidden all-to-all] in
mpmd/profiler/exchanges.py): per actor and step, in flight = blocked + hidden, from the
actors' records of when each exchange was issued, waited on and done."""

from __future__ import annotations

import math

import pytest

import mpmd
from mpmd.models.gpt import gpt_stages, lm_loss
from mpmd.profiler import StepRecord, profile_pipeline
from mpmd.profiler.exchanges import exchange_slices
from tests.models import sgd
from tests.mpmd.moe.test_expert_parallel import _config, _data

MICROBATCHES, DP, EP = 4, 2, 2


def test_hidden_is_in_flight_less_blocked_and_an_exchange_without_its_issue_time_is_all_blocked():
    # actor 0: one exchange issued at 0, held up from 30 to 50 (inside an overlap); one alone 60-70.
    # actor 1: an older record (no issue time), 5-9.
    rec = StepRecord(0, 100, 0.0, 1, [[], []],
                     exchanges=[((0, 30, 50, "dispatch", 0), (1, 60, 70, "combine", 60)), ((0, 5, 9, "dispatch"),)])
    slices, hiding = exchange_slices([rec], [["1F0", "1F1"]], 1, [0, 0])
    assert [(s.actor, s.name, s.start_ns, s.end_ns) for s in slices] == [
        (0, "'1F0' dispatch", 30, 50), (0, "'1F1' combine", 60, 70), (1, "'1F0' dispatch", 5, 9)]
    (a, b) = hiding
    assert (a.actor, a.exchanges) == (0, 2) and (a.in_flight_s, a.blocked_s, a.hidden_s) == pytest.approx((60e-9, 30e-9, 30e-9))
    assert a.hidden_fraction == pytest.approx(0.5)
    assert b.actor == 1 and (b.in_flight_s, b.blocked_s, b.hidden_s, b.hidden_fraction) == pytest.approx((4e-9, 4e-9, 0, 0))


def test_the_profile_of_an_overlapped_dualpipev_shows_all_to_all_hidden_behind_compute(ray_session):
    stages, (x, y) = gpt_stages(_config(), 4), _data(MICROBATCHES * DP)[0]
    with mpmd.Pipeline(stages, schedule="dualpipev", num_microbatches=MICROBATCHES, loss_fn=lm_loss, optimizer=sgd,
                       dp=DP, ep=EP, device="cpu", overlap=True) as pipe:
        report = profile_pipeline(pipe.engine, x, y, steps=1, warmup=0)  # one step: the test's time
    hiding = report.all_to_all_hiding
    assert {(h.actor, h.step) for h in hiding} == {(a, k) for a in range(report.num_actors) for k in range(1)}
    for h in hiding:
        blocked = sum(s.seconds for s in report.all_to_all if (s.actor, s.step) == (h.actor, h.step))
        assert math.isclose(h.blocked_s, blocked, rel_tol=1e-9, abs_tol=1e-12)  # the A2A slices are the blocked part
        assert h.hidden_s >= 0 and math.isclose(h.in_flight_s, h.blocked_s + h.hidden_s, rel_tol=1e-9, abs_tol=1e-12)
        assert 0 <= h.hidden_fraction <= 1
    # every actor runs OVERLAPs whose exchanges wait for the other side's compute: some of them hidden
    assert all(sum(h.hidden_s for h in hiding if h.actor == a) > 0 for a in range(report.num_actors))
    assert "hidden %" in report.summary()
