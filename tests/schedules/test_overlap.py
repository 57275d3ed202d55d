"""The OVERLAP action (Note [overlapped forward and backward] in schedules/actions.py): text,
refusals, lowering, the NCCL-order and rendezvous checks, compilation, costs; single process."""

from __future__ import annotations

from collections import Counter

import pytest

from actors.program import Instr, decode_program, encode_program, flat_program
from mpmd.runtime.compile import compile_programs, forward_only, pipeline_programs
from schedules import (
    COMM_KINDS,
    Action,
    Costs,
    Kind,
    Schedule,
    ScheduleError,
    flat,
    fuse_backwards,
    get_schedule,
    lower,
    simulate,
    simulate_blocking,
    validate,
)
from schedules.passes import sink_receives

# Two ranks, 1F1B order with rank 0's third forward overlapping its first backward.
ONE_F_ONE_B = "0F0 0F1 0F2+0B0 0B1 0B2\n1F0 1B0 1F1 1B1 1F2 1B2"
CASES = [(2, 4), (2, 5), (3, 6), (3, 7), (4, 8)]  # dualpipev (ranks, microbatches)


def _expanded(schedule: Schedule) -> Schedule:
    """Each OVERLAP written as its forward, then its backward, in place."""
    return schedule.replace(ranks=tuple(tuple(flat(acts)) for acts in schedule.ranks))


# -- the action and its text -------------------------------------------------------------------


def test_text_round_trip_and_fields():
    a = Action.parse("1F3+0I2")
    assert a == Action.overlap(Action(1, Kind.F, 3), Action(0, Kind.I, 2))
    assert (a.kind, a.stage, a.microbatch, a.fill_slot, a.tie_group) == (Kind.OVERLAP, 1, None, None, None)
    assert a.parts == (Action(1, Kind.F, 3), Action(0, Kind.I, 2)) == a.flat
    assert repr(a) == str(a) == "1F3+0I2" and Action.parse(" 1F3+0I2 ") == a
    assert Action(2, Kind.F, 0).flat == (Action(2, Kind.F, 0),)
    s = Schedule.from_text(ONE_F_ONE_B)
    assert s.to_text() == ONE_F_ONE_B and Schedule.from_text(s.to_text()) == s
    assert s.num_microbatches == 3 and s.stage_to_rank == (0, 1)  # read from inside the OVERLAP too
    assert "0F2+0B0" in s.render() and "0F2+0B0" in s.render(Costs(a2a_f=0.3))  # one cell: grid, order


@pytest.mark.parametrize("text, match", [
    ("1F3+0F2", "0F2 must be a backward"),
    ("0I2+1F3", "0I2 must be a forward"),
    ("1F3+0W2", "a W stays an action of its own"),
    ("1F3+0I2+0B1", "two actions joined by '\\+'"),
    ("1F3+0SEND_B2", "must be a backward"),
])
def test_bad_composites_are_refused_as_text(text, match):
    with pytest.raises(ValueError, match=match):
        Action.parse(text)


def test_bad_composites_are_refused_by_the_constructor():
    f, b = Action(1, Kind.F, 0), Action(0, Kind.B, 1)
    with pytest.raises(ValueError, match="only an OVERLAP has parts"):
        Action(1, Kind.F, 0, parts=(f, b))
    with pytest.raises(ValueError, match="OVERLAP takes no microbatch"):
        Action(1, Kind.OVERLAP, 0, parts=(f, b))
    with pytest.raises(ValueError, match="its stage is its forward's, 1"):
        Action(0, Kind.OVERLAP, parts=(f, b))
    with pytest.raises(ValueError, match="needs parts=\\(forward, backward\\)"):
        Action(1, Kind.OVERLAP, parts=(f,))
    with pytest.raises(ValueError, match="must be a forward"):
        Action.overlap(Action.overlap(f, b), b)


@pytest.mark.parametrize("text, match", [
    # the backward's stage lives on the other rank
    ("0F0 0F1+1B0 0B0 0B1\n1F0 1F1 1B1", "part 1B0 runs on rank 0, but stage 1 lives on rank 1"),
    # the same forward twice: once alone, once inside an OVERLAP
    ("0F0 0F1 0F1+0B0 0B1\n1F0 1B0 1F1 1B1", "part 0F1 appears twice"),
    # a part consumes the other part's output: the backward of the forward it overlaps
    ("0F0 0B0 0F1+0B1", "0F1\\+0B1 waits for 0F1"),
    # across ranks too: 1B1 needs 1F1, which needs 0F1's output sent after the OVERLAP
    ("0F0 0F1+0B0 0B1\n1F0 1B0 1F1 1B1", None),
])
def test_schedules_with_bad_composites_are_refused(text, match):
    if match is None:  # valid: 0B0's gradient needs only microbatch 0
        Schedule.from_text(text)
        return
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_text(text)


def test_a_forward_only_schedule_takes_no_overlap_and_forward_only_keeps_its_forward():
    s = Schedule.from_text(ONE_F_ONE_B)
    with pytest.raises(ScheduleError, match="overlaps a backward in a forward-only schedule"):
        validate(Schedule(s.ranks, 3, s.stage_to_rank, forward_only=True))
    fwd = forward_only(s)
    assert fwd.ranks[0] == (Action(0, Kind.F, 0), Action(0, Kind.F, 1), Action(0, Kind.F, 2))


# -- dualpipev ---------------------------------------------------------------------------------


@pytest.mark.parametrize("p, m", CASES)
def test_dualpipev_with_overlap_is_dualpipev_with_its_pairs_joined(p, m):
    plain, paired = get_schedule("dualpipev", p, m), get_schedule("dualpipev", p, m, overlap=True)
    assert _expanded(paired).ranks == plain.ranks
    overlaps = [a for acts in paired.ranks for a in acts if a.kind is Kind.OVERLAP]
    # phase 4 runs 2(m - 2p + r + 1) pairs on rank r, phase 5 (p - 1 - r)
    assert len(overlaps) == sum(2 * (m - 2 * p + r + 1) + (p - 1 - r) for r in range(p))
    assert all({x.stage for x in a.parts} == {a.stage, 2 * p - 1 - a.stage} for a in overlaps)  # one of each chunk
    fused = fuse_backwards(paired)  # a W right after its OVERLAP's I becomes a B inside it, where free
    assert any(a.parts[1].kind is Kind.B for acts in fused.ranks for a in acts if a.kind is Kind.OVERLAP)
    for r, acts in enumerate(fused.ranks):
        for a in acts:
            if a.kind is Kind.OVERLAP and a.parts[1].kind is Kind.B:
                b = a.parts[1]
                i, w = Action.overlap(a.parts[0], Action(b.stage, Kind.I, b.microbatch)), Action(b.stage, Kind.W, b.microbatch)
                assert list(paired.ranks[r]).index(w) == list(paired.ranks[r]).index(i) + 1, f"rank {r}: {a!r}"
    validate(fused)


def test_overlap_on_a_schedule_without_pairs_is_refused():
    with pytest.raises(ValueError, match="1f1b has no overlapped forward-backward pairs.*dualpipev"):
        get_schedule("1f1b", 2, 4, overlap=True)


@pytest.mark.parametrize("p, m", CASES)
def test_simulated_overlap_hides_the_all_to_alls(p, m):
    plain = fuse_backwards(get_schedule("dualpipev", p, m))
    paired = fuse_backwards(get_schedule("dualpipev", p, m, overlap=True))
    assert simulate(paired).makespan == simulate(plain).makespan  # no all-to-all: nothing to hide
    assert simulate(paired).peak_activations == simulate(plain).peak_activations
    costs = Costs(f=1.0, b=1.0, w=1.0, a2a_f=0.5, a2a_b=0.5)
    with_pairs, without = simulate(paired, costs), simulate(plain, costs)
    assert with_pairs.makespan < 0.9 * without.makespan
    # each rank waits on what it did not hide; without OVERLAP on all of it
    assert without.all_to_all_hidden == (0.0,) * p
    assert all(h > 0 for h in with_pairs.all_to_all_hidden)
    for r in range(p):
        everything = sum(costs.a2a(a) for a in plain.ranks[r])
        assert without.all_to_all[r] == pytest.approx(everything)
        assert with_pairs.all_to_all[r] + with_pairs.all_to_all_hidden[r] == pytest.approx(everything)


# -- lowering, deadlock and NCCL-order checks, compilation ------------------------------------


def _check_placed(lowered: Schedule) -> None:
    """Every receive a part of an OVERLAP needs is before it, every send of a part after it."""
    for r, acts in enumerate(lowered.ranks):
        for i, a in enumerate(acts):
            for part in (a.parts or ()):
                fwd = part.kind is Kind.F
                recv = Action(part.stage, Kind.RECV_F if fwd else Kind.RECV_B, part.microbatch)
                send = Action(part.stage, Kind.SEND_F if fwd else Kind.SEND_B, part.microbatch)
                assert recv not in acts[i:], f"rank {r}: {recv!r} after {a!r}"
                assert send not in acts[:i], f"rank {r}: {send!r} before {a!r}"


@pytest.mark.parametrize("p, m", CASES)
def test_lowering_sends_and_receives_what_forward_then_backward_does(p, m):
    paired = fuse_backwards(get_schedule("dualpipev", p, m, overlap=True))
    for dp in (1, 2):
        lowered = sink_receives(lower(paired, allreduce=dp > 1))
        reference = sink_receives(lower(_expanded(paired), allreduce=dp > 1))
        for r, (acts, ref) in enumerate(zip(lowered.ranks, reference.ranks)):
            assert Counter(a for a in acts if a.kind in COMM_KINDS) == Counter(a for a in ref if a.kind in COMM_KINDS)
            assert Counter(a for a in acts if a.kind in (Kind.FREE, Kind.ALLREDUCE)) == Counter(
                a for a in ref if a.kind in (Kind.FREE, Kind.ALLREDUCE)), f"rank {r}"
            assert [a for a in acts if a.kind not in COMM_KINDS | {Kind.FREE, Kind.ALLREDUCE}] == list(paired.ranks[r])
        _check_placed(lowered)
        assert simulate_blocking(lowered).transfers == simulate_blocking(reference).transfers
        simulate_blocking(lowered, semantics="nccl", dp=dp)  # ordered, as the actors post on NCCL
        simulate_blocking(lowered, semantics="nccl", dp=dp, relearn=True, fed=True)


def test_a_receive_after_its_overlap_is_caught_by_both_models():
    lowered = sink_receives(lower(Schedule.from_text(ONE_F_ONE_B)))
    acts = list(lowered.ranks[0])
    i, j = acts.index(Action.parse("0F2+0B0")), acts.index(Action(0, Kind.RECV_B, 0))
    acts[i], acts[j] = acts[j], acts[i]  # the gradient 0B0 needs now arrives after the OVERLAP
    bad = lowered.replace(ranks=(tuple(acts), lowered.ranks[1]))
    for semantics in ("rendezvous", "nccl"):
        with pytest.raises(ScheduleError, match="0B0 runs before its input 0RECV_B0"):
            simulate_blocking(bad, semantics=semantics)


@pytest.mark.parametrize("p, m", CASES[:3])
def test_compiled_overlap_carries_its_parts_as_forward_then_backward_would(p, m):
    paired = fuse_backwards(get_schedule("dualpipev", p, m, overlap=True))
    lowered = sink_receives(lower(paired, allreduce=True))
    programs = compile_programs(lowered)
    reference = compile_programs(_expanded(lowered))  # the same program with each OVERLAP as F then B
    for prog, ref in zip(programs, reference):
        assert [i for _, i in flat_program(prog)] == ref  # same buffers, peers and hand-overs
        assert decode_program(encode_program(prog)) == prog
        for ins in prog:
            if ins.kind is Kind.OVERLAP:
                assert (ins.microbatch, ins.buf, ins.peer, ins.aux) == (-1, -1, -1, -1)
                assert ins.action.kind is Kind.OVERLAP and ins.action.parts == tuple(x.action for x in ins.parts)
    shipped = pipeline_programs(paired, dp=2)
    assert any(i.kind is Kind.OVERLAP for prog in shipped["train"] for i in prog)
    assert not any(i.kind is Kind.OVERLAP for prog in shipped["forward"] for i in prog)
    assert Instr(Kind.F, 0, 1).flat == (Instr(Kind.F, 0, 1),)


# -- costs -------------------------------------------------------------------------------------


def test_an_overlap_costs_both_computes_and_the_all_to_all_neither_hid():
    c = Costs(f=[1.0, 2.0], b=[3.0, 0.5], w=1.0, a2a_f=[0.4, 2.5], a2a_b=[4.0, 0.2])
    f1, b0, i0, w0 = Action(1, Kind.F, 0), Action(0, Kind.B, 1), Action(0, Kind.I, 1), Action(0, Kind.W, 1)
    assert c.of(f1) == 2.0 + 2.5 and c.of(b0) == 4.0 + 4.0 and c.of(i0) == 3.0 + 4.0 and c.of(w0) == 1.0
    fb = Action.overlap(f1, b0)  # the forward's 2.5 behind the backward's 4.0; the backward's 4.0 behind 2.0
    assert c.hidden_a2a(fb) == 2.5 + 2.0 and c.exposed_a2a(fb) == 2.0 and c.a2a(fb) == 6.5
    assert c.of(fb) == 2.0 + 4.0 + 2.0
    fi = Action.overlap(f1, i0)
    assert c.of(fi) == 2.0 + 3.0 + (2.5 + 4.0 - min(2.5, 3.0) - min(4.0, 2.0))
    assert Costs().of(fb) == Costs().of(f1) + Costs().of(b0)  # no all-to-all: the two, one after the other
    tp = Costs(tp=2, tp_sharded=1.0, tp_forward=2, tp_bytes=10.0, tp_latency=0.1, a2a_f=0.3)
    assert tp.of(f1) == 0.5 + 0.2 + 0.3  # a2a after the TP share and collectives
    with pytest.raises(ValueError, match="Costs.a2a_b must be finite and >= 0"):
        Costs(a2a_b=-1.0)


def test_the_simulators_start_and_end_both_parts_with_their_overlap():
    s = Schedule.from_text(ONE_F_ONE_B)
    costs = Costs(f=1.0, b=2.0, w=0.0, a2a_f=1.0, a2a_b=1.0)
    runtime = Costs(f=1.0, b=2.0, w=0.0, a2a_f=1.0, a2a_b=1.0, task=0.01, message=0.01, latency=0.1)
    for sim in (simulate(s, costs), simulate(sink_receives(lower(s)), runtime)):
        o = Action.parse("0F2+0B0")
        assert sim.start[o] == sim.start[o.parts[0]] == sim.start[o.parts[1]]
        assert sim.end[o] == sim.end[o.parts[0]] == sim.end[o.parts[1]]
        assert sim.start[o] >= sim.end[Action(1, Kind.B, 0)]  # waits for the gradient its backward needs
    sim = simulate(s, costs)
    assert sim.end[Action.parse("0F2+0B0")] - sim.start[Action.parse("0F2+0B0")] == 1.0 + 2.0 + 0.0  # all hidden
    assert sim.busy[0] == 3 * 2.0 + 3 * 3.0 - 2.0  # 3 forwards, 3 backwards, less the 2 seconds hidden


def _paired_up(schedule: Schedule) -> Schedule:
    """Every F directly followed on its rank by a backward of another (stage, microbatch), joined."""
    ranks = []
    for acts in schedule.ranks:
        out = []
        for a in acts:
            prev = out[-1] if out else None
            if (prev is not None and prev.kind is Kind.F and a.kind in (Kind.B, Kind.I)
                    and (a.stage, a.microbatch) != (prev.stage, prev.microbatch)):
                out[-1] = Action.overlap(prev, a)
            else:
                out.append(a)
        ranks.append(tuple(out))
    return schedule.replace(ranks=tuple(ranks))


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zbv", "interleaved-1f1b"])
def test_overlaps_anywhere_they_can_finish_lower_to_programs_that_pass_both_checks(name):
    accepted = 0
    for p, m in ((2, 4), (3, 6)):
        paired = _paired_up(fuse_backwards(get_schedule(name, p, m)))
        try:
            validate(paired)
        except ScheduleError as e:  # a part waits, through the other ranks, for the other part
            assert "cannot finish" in str(e) and "+" in str(e)
            continue
        accepted += 1
        lowered = sink_receives(lower(paired, allreduce=True))
        _check_placed(lowered)
        simulate_blocking(lowered)
        simulate_blocking(lowered, semantics="nccl", dp=2)
        simulate_blocking(lowered, semantics="nccl", dp=2, relearn=True, fed=True)
        compile_programs(lowered)
    assert accepted
