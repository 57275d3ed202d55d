"""NCCL's order on the CPU (Note [NCCL order on the CPU] in actors/pair_queues.py), in two real
processes with the actors' ``Communicator``: each rank posts exactly what the NCCL-order model
(``schedules.posting.posts_of_rank``) says the worker posts.  Today's unordered prefetch times out
into an error (the actor watches each operation: Note [stuck operations]), as the model predicts;
the order the actors use on NCCL runs.  Interleaved 1F1B on three ranks runs on the actors'
point-to-point groups and times out with every message on the world group (one stream per rank,
as eager initialisation runs them: Note [point-to-point groups])."""

from __future__ import annotations

import multiprocessing
import zlib

import pytest
import torch

from actors.comm import Communicator, free_address
from schedules import DeadlockError, get_schedule, linked_ranks, lower, simulate_blocking
from schedules.nccl_order import step_peers
from schedules.posting import posts_of_rank

META = [((3,), "float32")]


def _code(message: tuple) -> float:
    return float(zlib.crc32(repr(message).encode()) % 1000)


def _run_rank(rank: int, address, ordered: bool, out, name: str = "1f1b", p: int = 2, m: int = 4,
              pairs: bool = True) -> None:
    try:
        low = lower(get_schedule(name, p, m), sink=True)
        # A group per linked pair, as the actors form them, or every message on one group of all ranks,
        # as torch runs them on an eagerly initialised world group.
        groups = linked_ranks(low) if pairs else [list(range(p))]
        comm = Communicator(world_size=p, rank=rank, address=address, backend="gloo", timeout_s=4.0, dp_groups=[],
                            device=torch.device("cpu"), queued=True, p2p_groups=groups)
        prog = low.ranks[rank]
        handles, got = {}, []
        for step in range(2):  # the second step posts receives ahead
            for x in posts_of_rank(prog, step_peers(low, prog), replica=0, num_ranks=p, rank=rank, window=2,
                                   ordered=ordered, relearn=step == 0, fed=None, train=True):
                if x.op == "send":
                    comm.send([torch.full((3,), _code(x.message))], x.peer)
                elif x.op == "recv":
                    handles[x.ident] = (x.message, comm.irecv(META, x.peer))
                elif x.op == "wait":
                    message, handle = handles.pop(x.ident)
                    (t,) = comm.wait_recv(handle)
                    assert t[0].item() == _code(message), "a message paired wrongly"
                    got.append(message)
                elif x.op == "flush":
                    comm.flush()
                elif x.op == "coll":
                    comm.all_true(True)
        out.put((rank, "ok", len(got)))
        comm.close()
    except Exception as e:  # noqa: BLE001 - reported to the test
        out.put((rank, "error", str(e)))


def _run(ordered: bool, name: str = "1f1b", p: int = 2, m: int = 4, pairs: bool = True) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    address = free_address()
    procs = [ctx.Process(target=_run_rank, args=(r, address, ordered, out, name, p, m, pairs)) for r in range(p)]
    for p in procs:
        p.start()
    results = {}
    for _ in procs:
        rank, status, detail = out.get(timeout=120)
        results[rank] = (status, detail)
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    return results


def test_todays_prefetch_times_out_under_nccl_order_and_the_ordered_one_runs():
    low = lower(get_schedule("1f1b", 2, 4), sink=True)
    with pytest.raises(DeadlockError):
        simulate_blocking(low, semantics="nccl", ordered=False)
    # two steps, four receives a step each (rank 1 gets a shape header before each activation in the first)
    assert _run(ordered=True) == {0: ("ok", 8), 1: ("ok", 12)}
    stuck = _run(ordered=False)
    assert any(status == "error" and "did not complete within 4s" in detail for status, detail in stuck.values()), stuck


def test_interleaved_on_three_ranks_needs_a_group_per_pair():
    low = lower(get_schedule("interleaved-1f1b", 3, 3), sink=True)
    with pytest.raises(DeadlockError, match="world group's one stream"):
        simulate_blocking(low, semantics="nccl", communicators="world")
    ran = _run(ordered=True, name="interleaved-1f1b", p=3, m=3)
    assert all(status == "ok" for status, _ in ran.values()), ran
    stuck = _run(ordered=True, name="interleaved-1f1b", p=3, m=3, pairs=False)
    assert any(status == "error" and "did not complete within 4s" in detail for status, detail in stuck.values()), stuck
