"""``python -m mpmd bench startup``: what starting a pipeline costs, phase by phase and per
actor, and how each phase grows with the number of actors (Note [start-up at scale] in
``mpmd/runtime/cluster.py``; the model at 1,024 and 4,096 actors is in docs/cluster.md).

Five tables:

* ``groups``: the process groups alone, in forked processes on this machine (gloo, every
  group kind: dp, tp, the ties of an embedding tied across the pipeline's ends, and the
  point-to-point pairs of NCCL's order, as ``transport="nccl-order"`` forms them), formed the
  way this runtime does (``members``: each actor forms only its own groups, Note [group
  formation] in actors/group_plan.py) against torch's default (``every``: every actor enters
  every ``new_group``), in alternating rounds.  Per actor: seconds in ``init_process_group``
  (the world group), seconds forming the other groups, and calls; the worst actor's figures.
* ``pipeline``: real pipelines on Ray (CPU, gloo, 1F1B of tiny stages), seconds per start-up
  phase on the controller (``Engine.startup``), with each actor's own world and group
  seconds, and the bytes of modules and programs shipped per actor.
* ``placement``: a placement group of B tiny bundles on this machine's Ray, from request to
  ready, and its removal.
* ``store``: the TCP store's gets per second to C processes at once (gloo's world group: every
  actor reads every other's address from the one store on rank 0's actor).
* ``plan``: group-creation calls per actor as planned (pure, no processes) at the sizes measured
  and at 1,024 and 4,096 actors: torch's default, gloo's members-only, NCCL's split rounds.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import statistics
import time
import types

from .harness import ensure_ray, print_table, progress

__all__ = ["HELP", "add_arguments", "run", "layouts", "plan_lists", "calls_table"]

HELP = "start-up per phase and per actor at 2-16 actors, group-creation calls planned up to 4,096"


def add_arguments(p) -> None:
    p.add_argument("--actors", type=int, nargs="+", default=[2, 4, 8, 16], help="world sizes measured")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per group-formation configuration")
    p.add_argument("--bundles", type=int, nargs="+", default=[16, 256, 1024, 4096], help="placement group sizes")
    p.add_argument("--skip", nargs="*", default=[], choices=["groups", "pipeline", "placement", "plan", "store"],
                   help="tables to leave out")
    p.set_defaults(run=run)


def layouts(n: int) -> list[tuple[str, int, int, int]]:
    """``(name, dp, pp, tp)`` grids of ``n`` actors: a deep pipeline, replicas of two ranks, a 3-D
    grid; at a thousand actors and more, the shapes of large runs (pp 16 x tp 8, pp 4)."""
    out = [("pp", 1, n, 1)]
    if 4 <= n <= 64:
        out.append(("dp x 2", n // 2, 2, 1))
    if 8 <= n <= 64:
        out.append(("dp x 2 x tp2", n // 4, 2, 2))
    if n >= 1024:
        out += [("dp x 16 x tp8", n // 128, 16, 8), ("dp x 4", n // 4, 4, 1)]
    return out


def plan_lists(dp: int, pp: int, tp: int) -> dict:
    """The group lists the engine gives every actor for a pipeline of one stage per rank (1F1B's
    placement: its ranks linked in a ring, the last to the first by the fed targets) on this grid,
    with an embedding tied between the first and the last stage (``Communicator``'s arguments)."""
    from actors.grid import DeviceGrid
    from schedules import linked_ranks

    grid = DeviceGrid(dp=dp, pp=pp, tp=tp)
    links = linked_ranks(types.SimpleNamespace(stage_to_rank=list(range(pp)), num_stages=pp))
    ties = [[grid.actor(d, 0, t), grid.actor(d, pp - 1, t)] for d in range(dp) for t in range(tp)] if pp > 1 else []
    return dict(dp_groups=grid.dp_groups(), tp_groups=grid.tp_groups(), p2p_groups=grid.pair_groups(links),
                tie_groups=ties)


def _rank(rank: int, world: int, port: int, lists: dict, formation: str, barrier, out) -> None:
    import torch
    import torch.distributed as dist

    from actors.comm import Communicator

    spent = {True: [0, 0.0], False: [0, 0.0]}  # member or not -> [calls, seconds]
    new_group = dist.new_group

    def timed_new_group(ranks, *args, **kwargs):  # each call timed, members' apart from the others'
        t0 = time.perf_counter()
        group = new_group(ranks, *args, **kwargs)
        spent[rank in ranks][0] += 1
        spent[rank in ranks][1] += time.perf_counter() - t0
        return group

    dist.new_group = timed_new_group
    barrier.wait()
    comm = Communicator(world_size=world, rank=rank, address=("127.0.0.1", port), backend="gloo", timeout_s=120.0,
                        device=torch.device("cpu"), queued=True, formation=formation, **lists)
    out.put((rank, comm.started[1], comm.groups.seconds, comm.groups.calls, spent[True], spent[False]))
    barrier.wait()  # rank 0 holds the store: everyone finishes first
    comm.close()


def measure_groups(world: int, lists: dict, formation: str) -> list[tuple]:
    """Form the groups in ``world`` forked processes; per rank ``(rank, world s, groups s, calls)``."""
    from actors.comm import free_address

    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(world), ctx.Queue()
    port = free_address()[1]
    procs = [ctx.Process(target=_rank, args=(r, world, port, lists, formation, barrier, out)) for r in range(world)]
    for p in procs:
        p.start()
    rows = sorted(out.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return rows


def groups_table(sizes: list[int], rounds: int) -> None:
    from actors.group_plan import GroupPlan

    results: dict = {}
    for _ in range(rounds):
        for n in sizes:
            for name, dp, pp, tp in layouts(n):
                for formation in ("every", "members"):  # alternating: a slow spell falls on both
                    progress(f"groups: {n} actors, {name}, {formation}")
                    results.setdefault((n, name, formation), []).append(measure_groups(n, plan_lists(dp, pp, tp),
                                                                                       formation))
    header = ["actors", "grid", "formation", "groups", "calls/actor", "world s", "groups ms", "every/members",
              "member call ms", "other call us"]
    rows = []
    med = statistics.median
    for (n, name, formation), runs in results.items():
        _, dp, pp, tp = next(x for x in layouts(n) if x[0] == name)
        lists = plan_lists(dp, pp, tp)
        total = len(GroupPlan.of(dp=lists["dp_groups"], tp=lists["tp_groups"], pairs=lists["p2p_groups"],
                                 ties=lists["tie_groups"]).groups)
        worst = [max(r[2] for r in run) for run in runs]
        ratio = ""
        if formation == "members":
            every = [max(r[2] for r in run) for run in results[(n, name, "every")]]
            ratio = f"{med(every) / max(med(worst), 1e-9):.2f}x"
        member = [sum(r[4][1] for r in run) / max(sum(r[4][0] for r in run), 1) for run in runs]
        other = [sum(r[5][1] for r in run) / sum(r[5][0] for r in run) for run in runs if sum(r[5][0] for r in run)]
        rows.append([str(n), name, formation, str(total), str(max(r[3] for run in runs for r in run)),
                     f"{med(max(r[1] for r in run) for run in runs):.3f}", f"{med(worst) * 1e3:.1f}", ratio,
                     f"{med(member) * 1e3:.2f}", f"{med(other) * 1e6:.0f}" if other else "-"])
    print(f"Process groups alone ({rounds} alternating rounds in forked processes, gloo, NCCL's pairs formed): "
          f"calls per actor (the most), seconds in init_process_group and in forming the other groups (the "
          f"slowest actor, median of rounds), mean time of one new_group call as a member and as a non-member")
    print_table(header, rows)


def _actor_figures(worker) -> tuple:
    comm = worker.comm
    return comm.started[0], comm.started[1], comm.groups.seconds, comm.groups.calls


def pipeline_table(sizes: list[int]) -> None:
    import torch

    from actors.program import encode_program

    from mpmd import Pipeline
    from mpmd.runtime.compile import FORWARD, TRAIN

    ensure_ray(max(sizes) + 2)
    header = ["actors", "grid", "checks", "placement", "first actor", "transport", "groups", "ship", "channels",
              "total s",
              "world s/actor max", "groups ms/actor max", "calls/actor", "module KB/actor", "program KB/actor"]
    rows = []
    for n in sizes:
        for name, dp, pp, tp in layouts(n)[:2]:
            progress(f"pipeline: {n} actors, {name}")
            t0 = time.perf_counter()
            with Pipeline([torch.nn.Linear(16, 16) for _ in range(pp)], schedule="1f1b", num_microbatches=2 * pp,
                          loss_fn=torch.nn.functional.mse_loss, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                          device="cpu", dp=dp, num_cpus=min(1.0, 2 / n)) as pipe:
                total = time.perf_counter() - t0
                engine = pipe.engine
                figures = engine.client.run_in_each(_actor_figures, "the actors' start-up figures")
                modules = max(len(engine.fleet.source.shipped(s)) for s in range(len(engine.stages)))
                programs = max(sum(len(encode_program(engine.program(k)[r])) for k in (TRAIN, FORWARD))
                               for r in range(pp))
                phases = engine.fleet.startup
            rows.append([str(n), name] + [f"{phases.get(k, 0.0):.2f}" for k in
                                          ("checks", "placement", "first actor", "transport", "groups", "ship",
                                           "channels")]
                        + [f"{total:.2f}", f"{max(f[1] for f in figures):.3f}",
                           f"{max(f[2] for f in figures) * 1e3:.1f}", str(max(f[3] for f in figures)),
                           f"{modules / 1024:.1f}", f"{programs / 1024:.1f}"])
    print("Pipelines on Ray (CPU, gloo, 1F1B of Linear(16, 16) stages), seconds per phase on the controller "
          "(first actor: its process up; groups: every other actor up and every group formed)")
    print_table(header, rows)


def placement_table(bundles: list[int], node_counts: tuple[int, ...] = (1, 8)) -> None:
    """Each bundle count on a fresh local Ray of ``nodes`` raylets (``ray.cluster_utils.Cluster``:
    all on this machine, 8 CPUs among them), bundles spread over the nodes."""
    import logging

    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, remove_placement_group

    rows = []
    for nodes in node_counts:
        ray.shutdown()
        cluster = Cluster()
        for _ in range(nodes):
            cluster.add_node(num_cpus=max(1, 8 // nodes))
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            for b in bundles:
                progress(f"placement: {b} bundles on {nodes} nodes")
                t0 = time.perf_counter()
                pg = placement_group([{"CPU": 0.001}] * b, strategy="SPREAD" if nodes > 1 else "PACK")
                ray.get(pg.ready(), timeout=900)
                ready = time.perf_counter() - t0
                remove_placement_group(pg)
                rows.append([str(nodes), str(b), str(-(-b // nodes)), f"{ready:.3f}", f"{ready / b * 1e3:.2f}"])
                time.sleep(1.0)  # the removal settles before the next request
        finally:
            ray.shutdown()
            cluster.shutdown()
    print("A placement group of B bundles ({'CPU': 0.001} each) on N raylets of this machine, request to ready")
    print_table(["nodes", "bundles", "per node", "ready s", "ms/bundle"], rows)


def _getter(port: int, key: str, gets: int, barrier, out) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(gets):
        store.get(key)
    out.put(time.perf_counter() - t0)


def store_table(clients: list[int], gets: int = 5000) -> None:
    """The TCP store's gets per second with ``clients`` processes reading at once: gloo's world
    group is N - 1 gets per actor, all served by this one store on rank 0's actor."""
    import torch.distributed as dist

    from actors.comm import free_address

    rows = []
    port = free_address()[1]
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=60))
    server.set("addr", b"x" * 320)  # about one actor's world-group entry (FileStore bytes / actor at 16 actors)
    ctx = multiprocessing.get_context("fork")
    for c in clients:
        progress(f"store: {c} clients")
        barrier, out = ctx.Barrier(c), ctx.Queue()
        procs = [ctx.Process(target=_getter, args=(port, "addr", gets, barrier, out)) for _ in range(c)]
        for p in procs:
            p.start()
        took = max(out.get(timeout=300) for _ in procs)
        for p in procs:
            p.join(timeout=60)
        rows.append([str(c), str(gets), f"{took:.2f}", f"{c * gets / took:,.0f}"])
    print("The TCP store (torch.distributed.TCPStore, one server) serving 320-byte gets to C client processes at once")
    print_table(["clients", "gets each", "s", "gets/s"], rows)


def calls_table(sizes: list[int]) -> list[list[str]]:
    """Group-creation calls per actor as planned, worst actor (rows for ``plan``)."""
    from actors.group_plan import GroupPlan

    rows = []
    for n in sizes:
        for name, dp, pp, tp in layouts(n):
            lists = plan_lists(dp, pp, tp)
            plan = GroupPlan.of(dp=lists["dp_groups"], tp=lists["tp_groups"], pairs=lists["p2p_groups"],
                                ties=lists["tie_groups"])
            members = max(plan.calls(r, "members") for r in range(n))
            rows.append([str(n), f"{name} ({dp}x{pp}x{tp})", str(plan.calls(0, "every")), str(members),
                         str(plan.calls(0, "split"))])
    return rows


def run(args) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sizes = sorted(set(args.actors))
    if "plan" not in args.skip:
        model = sizes + [1024, 4096]
        rows = calls_table(model)
        print("Group-creation calls per actor, planned (worst actor; the world group not counted): every = "
              "torch's default, members = gloo here, split = NCCL here (each a world-wide ncclCommSplit)")
        print_table(["actors", "grid (dp x pp x tp)", "every", "members", "split rounds"], rows)
    if "groups" not in args.skip:
        groups_table(sizes, args.rounds)
    if "pipeline" not in args.skip:
        pipeline_table(sizes)
    if "placement" not in args.skip:
        placement_table(args.bundles)
    if "store" not in args.skip:
        store_table([1, 2, 4, 8])
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    print(f"({stamp}, {os.cpu_count()} CPUs; model at 1,024 and 4,096 actors: docs/cluster.md)")
    return 0
