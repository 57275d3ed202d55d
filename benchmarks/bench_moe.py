"""``python -m mpmd bench moe``: what overlapping one microbatch's forward with another's backward
(``Pipeline(overlap=True)``, docs/overlap.md) does to the expert all-to-alls of a GPT-MoE on
DualPipeV at pp=2 x dp=2 x ep=2 (``--ranks 1``: pp=1, the V's two stages on one actor, 2 actors),
against the same schedule with each pair run forward then backward (``overlap=False`` on the schedule written with OVERLAPs: the same actions, the same
split backwards).

Both pipelines are alive at once and take turns round after round (Note [alternating
rounds] in harness.py); each turn runs ordinary steps (timed: the step time) and profiled
ones (each actor's seconds blocked on all-to-all, ``ProfileReport.all_to_all_seconds``).
The simulator's prediction of both: the unoverlapped pipeline's calibrated costs (its
profiled steps of the same rounds: each stage's all-to-all seconds per forward and per
backward, ``Costs.a2a_f`` / ``a2a_b``, apart from its compute; Note [all-to-all costs] in
schedules/costs.py), simulated on each pipeline's lowered program; the predicted blocked
seconds per actor are what its program leaves exposed (``SimResult.all_to_all``).  The simulator gives each
actor a device of its own; on CPU the actors share the machine's cores, so the prediction
is the larger of the simulated step and the actors' compute (the simulated busy time less
the exposed all-to-all, over every actor) spread over the cores: what the overlap hides is
then time another actor computes in anyway.  Medians over the rounds.
"""

from __future__ import annotations

import os
import random
import statistics

import torch

import schedules
from mpmd.models import GPTConfig, gpt_stages, lm_loss
from mpmd.pipeline import Pipeline
from mpmd.profiler import lowered_from_programs, profile_pipeline
from .harness import PipelineSet, ensure_ray, median_ratio, print_table, progress, timed

__all__ = ["HELP", "add_arguments", "run", "predicted"]

HELP = "time blocked on expert all-to-all and step time, DualPipeV overlapped against not (pp=2|1 x dp=2 x ep=2 MoE)"

KEYS = ("overlap", "plain")


def add_arguments(p) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: both pipelines' 8 actors share one GPU")
    p.add_argument("--microbatches", type=int, default=8, help="per replica and step (dualpipev: >= 4)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step, both replicas together")
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=4, help="GPT blocks, each a MoE (4 stages: >= 4)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per pipeline and round")
    p.add_argument("--profiled", type=int, default=2, help="profiled steps per pipeline and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ranks", type=int, default=2, choices=(1, 2),
                   help="pipeline ranks: 2 (4 actors) or 1 (2 actors: on 2 cores each actor has a core to itself)")
    p.set_defaults(run=run)


def run(args) -> int:
    ranks = args.ranks
    if args.microbatches < 2 * ranks or args.batch_size % (2 * args.microbatches) or args.layers < 2 * ranks:
        raise SystemExit(f"bench moe: dualpipev on {ranks} ranks needs --microbatches >= {2 * ranks}, a --batch-size "
                         f"divisible by 2 x microbatches (2 replicas) and --layers >= {2 * ranks} ({2 * ranks} stages)")
    ensure_ray(8)
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=4,
                    n_layers=args.layers, n_experts=args.experts, top_k=args.top_k)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(2))
    where = {"device": "cuda", "num_gpus": 0.125} if args.device == "cuda" else {"device": "cpu"}  # 8 actors, one GPU
    # One schedule for both: dualpipev's pairs as OVERLAPs, which overlap=False runs as their
    # forward then their backward; the same actions, the same split backwards (fuse_backwards
    # fuses a different set of I + W around OVERLAPs than without them).
    written = schedules.fuse_backwards(schedules.get_schedule("dualpipev", ranks, args.microbatches, overlap=True))
    steps: dict = {k: [] for k in KEYS}
    blocked: dict = {k: [] for k in KEYS}  # per round, per actor
    reports: dict = {k: [] for k in KEYS}
    with PipelineSet() as pipes:
        for key in KEYS:
            progress(f"  starting the {key} pipeline")
            pipes[key] = Pipeline(gpt_stages(cfg, 2 * ranks), schedule=written, num_microbatches=args.microbatches,
                                  num_actors=ranks, dp=2, ep=2, loss_fn=lm_loss, overlap=key == "overlap",
                                  optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), **where)
            pipes[key].step(x, y)
            pipes[key].step(x, y)
        order, shuffle = list(KEYS), random.Random(0)
        for r in range(args.rounds):
            progress(f"  round {r + 1}/{args.rounds}")
            shuffle.shuffle(order)
            for key in order:
                pipe = pipes[key]
                pipe.step(x, y)  # back from the other pipeline's turn
                steps[key].append([timed(pipe.step, x, y) for _ in range(args.steps)])
                rep = profile_pipeline(pipe.engine, x, y, steps=args.profiled, warmup=0)
                blocked[key].append(rep.all_to_all_seconds)
                reports[key].append(rep)
        programs = {k: pipes[k].engine.program("train") for k in KEYS}
        lowered = {k: lowered_from_programs(pipes[k].engine.schedule, programs[k]) for k in KEYS}
    actors = 2 * ranks
    cores = min(os.cpu_count() or 1, actors) if args.device == "cpu" else actors  # one GPU: not modelled (no bound)
    sims = [predicted(rep.calibrated_costs, lowered, replicas=2, cores=cores) for rep in reports["plain"]]
    _print(args, steps, blocked, sims, reports, cores)
    return 0


def predicted(costs: schedules.Costs, lowered: dict, replicas: int, cores: int) -> dict:
    """Per pipeline: the predicted step seconds (the simulated step, or the actors' compute
    spread over ``cores`` when that is longer), per rank the all-to-all seconds its program
    leaves exposed (``SimResult.all_to_all``), and the simulated step alone."""
    out = {}
    for k, low in lowered.items():
        sim = schedules.simulate(low, costs)
        compute = replicas * sum(busy - a2a for busy, a2a in zip(sim.busy, sim.all_to_all))
        out[k] = (max(sim.step_time, compute / cores), sim.all_to_all, sim.step_time)
    return out


def _print(args, steps: dict, blocked: dict, sims: list, reports: dict, cores: int) -> None:
    med = statistics.median
    num = len(blocked["plain"][0])
    step = {k: med(t for r in steps[k] for t in r) for k in KEYS}
    # ratios paired by round (Note [alternating rounds]): a slow spell falls on both turns of a round
    step_ratio = median_ratio((med(r) for r in steps["overlap"]), (med(r) for r in steps["plain"]))
    a2a_ratio = median_ratio((sum(r) for r in blocked["overlap"]), (sum(r) for r in blocked["plain"]))
    actor = {k: [med(r[a] for r in blocked[k]) for a in range(num)] for k in KEYS}
    total = {k: med(sum(r) / num for r in blocked[k]) for k in KEYS}
    sim_step = {k: med(s[k][0] for s in sims) for k in KEYS}
    ranks = args.ranks  # actor a is pipeline rank a % ranks of replica a // ranks
    sim_a2a = {k: [med(s[k][1][a % ranks] for s in sims) for a in range(num)] for k in KEYS}
    sim_alone = {k: med(s[k][2] for s in sims) for k in KEYS}
    cal = {k: med(r.calibrated_step_seconds for r in reports[k]) for k in KEYS}
    profiled = {k: med(t for r in reports[k] for t in r.step_seconds_each) for k in KEYS}
    print(f"GPT-MoE d_model {args.d_model}, {args.layers} MoE blocks of {args.experts} experts (top {args.top_k}), seq "
          f"{args.seq_len}, batch {args.batch_size} = 2 replicas x {args.microbatches} microbatches; dualpipev pp={ranks} x "
          f"dp=2 x ep=2 on {args.device}; medians over {args.rounds} alternating rounds ({args.steps} timed + "
          f"{args.profiled} profiled steps each)")
    rows = []
    for k in KEYS:
        rows.append([k, f"{step[k] * 1e3:.1f}", f"{sim_step[k] * 1e3:.1f}", f"{step[k] / sim_step[k]:.2f}",
                     f"{profiled[k] * 1e3:.1f}", f"{profiled[k] / sim_step[k]:.2f}", f"{sim_alone[k] * 1e3:.1f}", f"{cal[k] * 1e3:.1f}", f"{total[k] * 1e3:.1f}"]
                    + [f"{m * 1e3:.1f} / {p * 1e3:.1f}" for m, p in zip(actor[k], sim_a2a[k])])
    print_table(["run", "step ms", "predicted ms", "measured/pred", "profiled ms", "profiled/pred", "simulated ms",
                 "calibrated ms", "a2a ms/actor"]
                + [f"a2a r{a % ranks}/d{a // ranks} ms (sim)" for a in range(num)], rows)
    hidden = {k: med(h.hidden_fraction for r in reports[k] for h in r.all_to_all_hiding) for k in KEYS}
    print(f"all-to-all hidden behind compute (Note [hidden all-to-all]), the median over actors and profiled steps: "
          f"overlap {hidden['overlap']:.0%}, plain {hidden['plain']:.0%}")
    print(f"overlap / plain, the median of the rounds' ratios: blocked on all-to-all {a2a_ratio:.2f}x, step time "
          f"{step_ratio:.2f}x (predicted {sim_step['overlap'] / sim_step['plain']:.2f}x)")
    print(f"a2a: each actor's seconds per step blocked on expert all-to-alls (profiled steps); profiled: the wall time of the profiled steps the prediction is fitted on; simulated: the plain "
          f"run's calibrated costs with a2a_f/a2a_b per stage, on each run's program; predicted: that, or the actors' "
          f"compute over {cores} shared cores/devices when longer; calibrated: each run's own profile fitted and "
          f"simulated (its compute includes what it waited on all-to-all)")
