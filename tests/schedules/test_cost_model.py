"""The runtime terms of the cost model (Note [runtime costs] in schedules/costs.py), the
instruction-level simulator, and fitting latency, bandwidth and per-task overhead."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from schedules import Action, Costs, Kind, Link, Schedule, fit_link, fit_overhead, get_schedule, lower, simulate


def test_default_costs_simulate_as_before():
    for name in ("1f1b", "interleaved-1f1b", "zbv", "dualpipev"):
        s = get_schedule(name, 2, 4)
        assert not Costs(f=1, b=2, w=0.5, comm=0.25).charges_runtime
        plain = simulate(s, Costs(f=1, b=2, w=0.5, comm=0.25))
        assert simulate(lower(s), Costs(f=1, b=2, w=0.5, comm=0.25)).makespan == plain.makespan
        assert plain.step_time == pytest.approx(max(plain.end.values()))


def test_lowered_program_with_tiny_runtime_terms_matches_the_compute_model():
    """Lowered for these costs, the program's receives sit where the messages arrive, so
    running it instruction by instruction changes nothing.  (With a hop cost, a receive
    sits at the send's end, not at the arrival, and holds its rank until the message is
    there: the runtime pays that, and so does the instruction-level model.)"""
    costs = Costs(f=1, b=1.5, w=0.5)
    for name in ("1f1b", "interleaved-1f1b", "zbv", "dualpipev"):
        s = get_schedule(name, 2, 8)
        base = simulate(s, costs)
        fine = simulate(lower(s, costs=costs), Costs(f=1, b=1.5, w=0.5, task=1e-9))
        assert fine.makespan == pytest.approx(base.makespan, abs=1e-6), name
        assert fine.bubble_fraction == pytest.approx(base.bubble_fraction, abs=1e-6), name


HAND = Costs(f=1, b=2, w=0, task=0.1, message=0.05, latency=0.2, bandwidth=1000, activation_bytes=100,
             optimizer=(1, 2), step_overhead=0.5)


def test_hand_computed_lowered_step():
    # rank 0: 0F0 0SEND_F0 0RECV_B0 0B0 0FREE0;  rank 1: 1RECV_F0 1F0 1B0 1SEND_B0 1FREE0
    # transfer = 0.2 + 100 / 1000 = 0.3.  rank 0: F 0..1.1, SEND 1.1..1.25.  rank 1: RECV posted at 0,
    # message arrives 1.25 + 0.3 = 1.55, RECV ends 1.6; F 1.6..2.7; B 2.7..4.8; SEND 4.8..4.95; FREE ..5.05.
    # rank 0: RECV_B from 1.25, arrival 4.95 + 0.3 = 5.25, ends 5.3; B 5.3..7.4; FREE ..7.5; + optimizer 1 = 8.5.
    # rank 1: its send delivered at 5.25 (after its FREE), + optimizer 2 = 7.25.  Step: 8.5 + 0.5.
    s = lower(get_schedule("1f1b", 2, 1))
    r = simulate(s, HAND)
    assert r.step_time == pytest.approx(9.0)
    ends = {repr(a): t for a, t in r.end.items()}
    assert ends["1RECV_F0"] == pytest.approx(1.6) and ends["0RECV_B0"] == pytest.approx(5.3)
    assert r.makespan == pytest.approx(7.4)  # rank 0: 0F0 at 0 .. 0B0 at 7.4
    assert r.busy == (3.0, 3.0)


def test_send_replaces_message_at_the_sending_end_only():
    import dataclasses

    s = lower(get_schedule("1f1b", 2, 1))
    # two sends on the critical path (0SEND_F0, 1SEND_B0), each 0.25 longer than HAND's 0.05
    assert simulate(s, dataclasses.replace(HAND, send=0.3)).step_time == pytest.approx(9.5)
    assert simulate(s, dataclasses.replace(HAND, send=None)).step_time == pytest.approx(9.0)
    assert Costs(send=0.5).charges_runtime and Costs(message=0.5).send_message == 0.5
    with pytest.raises(ValueError, match="Costs.send must be None"):
        Costs(send=-1.0)


def test_a_late_launch_delays_the_rank_and_its_peers():
    import dataclasses

    s = lower(get_schedule("1f1b", 2, 1))
    late = simulate(s, dataclasses.replace(HAND, launch=(1.0, 0.0)))
    assert late.step_time == pytest.approx(10.0)  # every step of the chain above, 1 later
    assert late.start[next(a for a in s.ranks[0])] == pytest.approx(1.0)


def test_per_pair_links_override_latency_and_bandwidth():
    s = lower(get_schedule("1f1b", 2, 1))
    slow_back = Costs(**{**HAND.__dict__, "links": {(1, 0): (1.2, 1000)}})  # 1.3 instead of 0.3 on 1 -> 0
    assert simulate(s, slow_back).step_time == pytest.approx(10.0)
    with pytest.raises(ValueError, match=r"links\[\(1, 0\)\] must be"):
        Costs(links={(1, 0): (-1.0, 10)})


def test_prefetched_receives_overlap_the_transfer_with_compute():
    """A message posted ahead moves while the receiver computes; unposted, it moves only
    once the receiver reaches the receive."""
    s = lower(get_schedule("1f1b", 2, 8))
    slow_wire = dict(f=1.0, b=1.0, w=0.0, latency=1.5, task=0.01)
    rendezvous = simulate(s, Costs(**slow_wire, prefetch=0)).step_time
    ahead = simulate(s, Costs(**slow_wire, prefetch=2)).step_time
    assert ahead < rendezvous - 1.0, (ahead, rendezvous)


def test_compute_only_schedule_charges_task_transfer_and_optimizer():
    s = get_schedule("1f1b", 2, 1)  # 0F0 -> 1F0 -> 1B0 -> 0B0
    r = simulate(s, Costs(f=1, b=2, w=0, task=0.1, latency=0.2, bandwidth=1000, activation_bytes=100,
                          optimizer=(1, 2), step_overhead=0.5))
    # 0F0 0..1.1; 1F0 1.4..2.5; 1B0 2.5..4.6; 0B0 4.9..7.0; rank 0 + 1 = 8.0, rank 1 4.6 + 2; + 0.5
    assert r.step_time == pytest.approx(8.5)


@pytest.mark.parametrize("field,value,match", [
    ("task", -1.0, "Costs.task must be finite and >= 0"),
    ("bandwidth", 0.0, "Costs.bandwidth must be > 0"),
    ("prefetch", -1, "Costs.prefetch must be an int >= 0"),
    ("optimizer", (1.0, math.nan), "Costs.optimizer must be finite"),
])
def test_bad_runtime_terms_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        Costs(**{field: value})


def test_a_fused_backward_costs_fused_when_given_else_b_plus_w():
    mixed = Schedule.from_text(["0F0 0F1 0B0 0B1", "1F0 1I0 1W0 1F1 1B1"])
    assert Costs(b=2.0, w=1.0).of(Action(1, Kind.B, 1)) == 3.0
    cheaper = Costs(b=2.0, w=1.0, fused=(2.5, 2.0))
    assert [cheaper.of(Action(1, k, 0)) for k in (Kind.B, Kind.I, Kind.W)] == [2.0, 2.0, 1.0]
    r = simulate(mixed, cheaper)  # 1F0 1..2, 1I0 2..4, 1W0 4..5, 1F1 5..6, 1B1 6..8; 0B0 4..6.5, 0B1 8..10.5
    assert r.end[Action(1, Kind.B, 1)] == 8.0 and r.makespan == 10.5
    with pytest.raises(ValueError, match="Costs.fused must be None"):
        Costs(fused=(1.0, -1.0))


def test_optimizer_values_per_rank_must_cover_the_ranks():
    with pytest.raises(ValueError, match="Costs.optimizer has 2 values but the schedule has rank 2"):
        simulate(get_schedule("1f1b", 3, 3), Costs(optimizer=(1.0, 1.0)))


# -- fitting ---------------------------------------------------------------------------------------------
def test_fit_link_recovers_latency_and_bandwidth_from_noisy_timings():
    rng = random.Random(0)
    latency, bandwidth = 80e-6, 2.5e9  # 80 us, 2.5 GB/s
    samples = []
    for _ in range(300):
        nbytes = rng.choice([4096, 65536, 2**20, 4 * 2**20, 16 * 2**20])
        seconds = (latency + nbytes / bandwidth) * (1 + rng.gauss(0, 0.02)) + rng.gauss(0, 2e-6)
        samples.append((nbytes, seconds))
    fit = fit_link(samples)
    assert fit.latency == pytest.approx(latency, rel=0.05)
    assert fit.bandwidth == pytest.approx(bandwidth, rel=0.03)
    assert fit.samples == 300 and fit.residual < 1e-4


def test_fit_link_with_one_size_puts_everything_in_latency():
    fit = fit_link([(1000, 0.002), (1000, 0.004)])
    assert (fit.latency, fit.bandwidth) == (pytest.approx(0.003), math.inf)
    assert Link(fit.latency, fit.bandwidth).seconds(10**9) == pytest.approx(0.003)


def test_fit_overhead_recovers_the_fixed_cost_of_a_task():
    rng = random.Random(1)
    overhead = 150e-6
    samples = []
    for _ in range(400):
        compute = rng.uniform(0.5e-3, 20e-3)
        samples.append((compute, overhead + compute * 1.0 + rng.gauss(0, 5e-6)))
    fit = fit_overhead(samples)
    assert fit.overhead == pytest.approx(overhead, rel=0.03)
    assert fit.scale == pytest.approx(1.0, rel=0.01)


def test_fit_refuses_no_samples():
    with pytest.raises(ValueError, match="fit_link needs at least one"):
        fit_link([])
    with pytest.raises(ValueError, match="fit_overhead needs at least one"):
        fit_overhead([])


def test_costs_stay_hashable_values():
    a, b = Costs(f=(1, 2), links={(0, 1): (1e-3, 1e9)}), Costs(f=(1, 2), links={(0, 1): Link(1e-3, 1e9)})
    assert a == b and hash(a) == hash(b) and len({a, b, Costs()}) == 2


# -- the data-parallel all-reduce --------------------------------------------------------------------------
def test_allreduce_costs_a_ring_over_the_replicas():
    c = Costs(dp=4, grad_bytes=(1000, 4000), allreduce_latency=0.5, allreduce_bandwidth=100)
    # a ring moves 2 (n - 1) / n of the gradient through each replica: 1.5 x bytes with 4
    assert c.allreduce(0) == pytest.approx(0.5 + 1.5 * 1000 / 100)
    assert c.allreduce(1) == pytest.approx(0.5 + 1.5 * 4000 / 100)
    assert c.charges_allreduce and c.charges_runtime
    one = Costs(dp=1, grad_bytes=1000, allreduce_latency=0.5, allreduce_bandwidth=100)
    assert one.allreduce(0) == 0.0 and not one.charges_allreduce and not one.charges_runtime
    assert not Costs(dp=2).charges_allreduce  # nothing set: free, as before
    assert hash(c) == hash(Costs(dp=4, grad_bytes=(1000, 4000), allreduce_latency=0.5, allreduce_bandwidth=100))


def test_allreduce_holds_its_rank_in_both_simulators():
    """Lowered, stage s's ALLREDUCE sits after its last backward and that backward's send;
    compute-only, the rank pays it after that backward: on 1F1B both put rank 0's at the
    very end (one step longer by it) and rank 1's under rank 0's last backward."""
    s = get_schedule("1f1b", 2, 4)
    base = dict(f=1, b=2, w=0)
    plain = simulate(lower(s, allreduce=True), Costs(**base, task=1e-9)).step_time
    for ar in ((3.0, 0.0), (3.0, 2.0), (0.0, 9.0)):
        c = Costs(**base, task=1e-9, dp=2, allreduce_latency=ar)
        lowered = simulate(lower(s, allreduce=True), c).step_time
        compute_only = simulate(s, c).step_time
        assert lowered == pytest.approx(compute_only, abs=1e-6), ar
        # rank 1 ends its last backward 2 before rank 0 ends (0B3, 2 long, after a hop-free 1B3)
        assert lowered == pytest.approx(plain + max(ar[0], ar[1] - 2.0), abs=1e-6), ar


def test_an_overlapped_allreduce_charges_only_what_the_last_backward_did_not_cover():
    """overlap_reduce (Note [runtime costs]): the ring's transfer runs beside the stage's last
    backward (rank 0's 0B3, 2 long, ends the step), the fixed latency after it; in both simulators."""
    s = get_schedule("1f1b", 2, 4)
    base = dict(f=1, b=2, w=0, task=1e-9)
    none = simulate(lower(s, allreduce=True), Costs(**base)).step_time
    for latency, transfer in ((0.5, 1.0), (0.5, 3.0), (0.0, 9.0), (2.0, 0.0)):
        plain = Costs(**base, dp=2, grad_bytes=1000.0, allreduce_latency=latency, allreduce_bandwidth=1000.0 / transfer
                      if transfer else math.inf)  # a 2-replica ring moves grad_bytes through each
        over = dataclasses.replace(plain, overlap_reduce=True)
        for run in (lambda c: simulate(lower(s, allreduce=True), c), lambda c: simulate(s, c)):
            assert run(plain).step_time == pytest.approx(none + latency + transfer, abs=1e-6)
            assert run(over).step_time == pytest.approx(none + latency + max(0.0, transfer - 2.0), abs=1e-6)


@pytest.mark.parametrize("field,value,match", [
    ("dp", 0, "Costs.dp must be an int >= 1"),
    ("allreduce_bandwidth", 0.0, "Costs.allreduce_bandwidth must be > 0"),
    ("grad_bytes", (1.0, -1.0), "Costs.grad_bytes must be finite and >= 0"),
    ("allreduce_latency", math.inf, "Costs.allreduce_latency must be finite and >= 0"),
])
def test_bad_allreduce_terms_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        Costs(**{field: value})


def test_costs_pickle_round_trip():
    import pickle

    c = Costs(f=(1, 2), links={(0, 1): (1e-3, 1e9)}, dp=2, grad_bytes=(10, 20), allreduce_latency=1e-3)
    assert pickle.loads(pickle.dumps(c)) == c and isinstance(pickle.loads(pickle.dumps(c)).links[(0, 1)], Link)


# -- receives sunk past the work before their consumer (passes.sink_receives) --------------------------------
def test_sunk_receives_stay_deadlock_free_and_order_matched():
    from schedules import schedule_names, simulate_blocking

    changed = 0
    for name in schedule_names():
        for p, m in ((1, 3), (2, 4), (3, 6), (4, 8)):
            try:
                s = get_schedule(name, p, m)
            except ValueError:
                continue  # a (p, m) this schedule does not take
            for allreduce in (False, True):
                plain, sunk = lower(s, allreduce=allreduce), lower(s, allreduce=allreduce, sink=True)
                simulate_blocking(sunk)  # raises on a deadlock or a mismatched message
                changed += plain.ranks != sunk.ranks
                comm = lambda low: [[a for a in acts if a.kind.value.startswith(("SEND", "RECV"))] for acts in low.ranks]  # noqa: E731
                assert comm(sunk) == comm(plain), (name, p, m)  # each rank's sends and receives keep their order
    assert changed > 0


def test_sunk_receive_lets_the_rank_work_while_its_message_travels():
    s = lower(get_schedule("1f1b", 2, 2))
    assert " ".join(map(repr, lower(get_schedule("1f1b", 2, 2), sink=True).ranks[1])) == (
        "1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1FREE0 1F1 1B1 1SEND_B1 1FREE1")
    assert s.ranks[1][2:4] == tuple(map(Action.parse, ("1RECV_F1", "1B0")))  # lowered: the receive first
    # ZB-V with a hop and costs like the bench GPT's: the rank runs its W (or the other
    # stage's F) instead of holding in a receive
    z = get_schedule("zbv", 2, 8)
    c = Costs(f=3e-3, b=3e-3, w=4e-3, task=1e-5, message=2e-4, latency=3e-4, prefetch=2)
    assert simulate(lower(z, sink=True), c).step_time < 0.98 * simulate(lower(z), c).step_time  # 0.966
