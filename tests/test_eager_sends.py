"""Note [eager sends]: each send moves to just after its producer, and the programs
still finish with non-blocking sends, pairing the k-th send with the k-th receive."""

from __future__ import annotations

from collections import defaultdict, deque

import pytest

from schedules import Action, Kind, Schedule, eager_sends, get_schedule, lower
from schedules.blocking import peer_of

PRODUCER = {Kind.SEND_F: (Kind.F,), Kind.SEND_B: (Kind.B, Kind.I)}

CASES = [(name, p, m) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)
         for name in ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")]
CASES += [("zb-h2", p, 2 * p) for p in (2, 3, 4)] + [("dualpipev", p, 2 * p) for p in (2, 3, 4)]


def run_buffered(schedule: Schedule) -> int:
    """Execute with sends that never block (gloo's ``isend``); a receive waits for its
    channel's next message, which must be the one it expects.  Returns the steps taken;
    raises AssertionError on a hang or a mismatched message."""
    progs = schedule.ranks
    pc = [0] * len(progs)
    channels: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> messages in flight
    steps = 0
    while any(pc[r] < len(p) for r, p in enumerate(progs)):
        progressed = False
        for r, prog in enumerate(progs):
            while pc[r] < len(prog):
                a = prog[pc[r]]
                if a.kind in (Kind.SEND_F, Kind.SEND_B):
                    channels[(r, peer_of(schedule, a))].append(a)
                elif a.kind in (Kind.RECV_F, Kind.RECV_B):
                    queue = channels[(peer_of(schedule, a), r)]
                    if not queue:
                        break
                    sent = queue.popleft()
                    step = +1 if sent.kind is Kind.SEND_F else -1
                    assert (a.kind, a.stage, a.microbatch) == (
                        Kind.RECV_F if sent.kind is Kind.SEND_F else Kind.RECV_B, sent.stage + step, sent.microbatch
                    ), f"rank {r} expected {a!r} but the channel delivered {sent!r}"
                pc[r] += 1
                steps += 1
                progressed = True
        assert progressed, "hang: " + ", ".join(f"rank {r} at {progs[r][pc[r]]!r}" for r in range(len(progs))
                                                 if pc[r] < len(progs[r]))
    assert not any(channels.values()), "a message was never received"
    return steps


@pytest.mark.parametrize("name,p,m", CASES, ids=[f"{n}-p{p}-m{m}" for n, p, m in CASES])
@pytest.mark.parametrize("allreduce", (False, True))
def test_eager_sends_follow_their_producers_and_finish_with_buffered_sends(name, p, m, allreduce):
    lowered = lower(get_schedule(name, num_ranks=p, num_microbatches=m), allreduce=allreduce)
    eager = eager_sends(lowered)
    for before, after in zip(lowered.ranks, eager.ranks):
        assert sorted(before) == sorted(after)  # the same actions, moved
        non_sends = [a for a in before if a.kind not in PRODUCER]
        assert [a for a in after if a.kind not in PRODUCER] == non_sends  # everything else keeps its order
        for i, a in enumerate(after):
            if a.kind in PRODUCER:  # right after its producer (or after the send placed there first)
                j = i - 1
                while after[j].kind in PRODUCER:
                    j -= 1
                assert (after[j].kind, after[j].stage, after[j].microbatch) in {
                    (k, a.stage, a.microbatch) for k in PRODUCER[a.kind]}, f"{a!r} follows {after[j]!r}"
        for peer in range(p):  # per channel, the sends keep their order
            def sends(acts):
                return [a for a in acts if a.kind in PRODUCER and peer_of(lowered, a) == peer]
            assert sends(after) == sends(before)
    run_buffered(lowered)
    run_buffered(eager)


def test_a_send_moves_ahead_of_a_receive_that_would_delay_it():
    lowered = lower(get_schedule("interleaved-1f1b", num_ranks=2, num_microbatches=8))
    text = " ".join(map(repr, lowered.ranks[1][:7]))
    assert text == "1RECV_F0 1F0 1RECV_F1 1SEND_F0 1F1 3RECV_F0 1SEND_F1"
    assert " ".join(map(repr, eager_sends(lowered).ranks[1][:7])) == "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 3RECV_F0"


def test_the_buffered_runner_catches_a_mismatched_pairing():
    lowered = lower(get_schedule("1f1b", num_ranks=2, num_microbatches=2))
    r0 = list(lowered.ranks[0])
    i, j = r0.index(Action(0, Kind.SEND_F, 0)), r0.index(Action(0, Kind.SEND_F, 1))
    r0[i], r0[j] = r0[j], r0[i]
    swapped = lowered.replace(ranks=(tuple(r0),) + lowered.ranks[1:])
    with pytest.raises(AssertionError, match="expected 1RECV_F0"):
        run_buffered(swapped)
