"""``python -m mpmd bench tp``: what tensor parallelism inside a stage (``tp=2``) saves and
costs against ``tp=1``, on the bench GPT (``mpmd.models.GPTStage``) and on a tiny Hugging
Face Llama (built from ``LlamaConfig``, split by ``mpmd.split``), both ``pp=2`` with
``tp_plan="auto"``, every pipeline alive at once in one run.

Per pipeline rank: the bytes each actor holds after a step (``memory_bytes`` on the actors:
parameters, gradients, AdamW state; the largest over the rank's TP group), the bytes of the
parameters the plan shards (an actor's parameter bytes less those the plan leaves whole,
which the controller reads off the resolved plan with ``param_placements``) and their ratio
``tp=2 / tp=1`` (1/2 when the shards are even), and the step time ``tp=2 / tp=1``.  Step
times are medians over alternating rounds, so a slow spell on a shared machine falls on
every configuration.  On CPU every TP collective is a gloo round trip between processes
sharing the cores: the step-time ratio is reported, not a target.
"""

from __future__ import annotations

import statistics

import torch

from mpmd.models import GPTConfig, gpt_stages, lm_loss
from mpmd.pipeline import Pipeline
from mpmd.tensor_parallel import param_placements
from .harness import PipelineSet, ensure_ray, print_table, time_rounds

__all__ = ["HELP", "add_arguments", "run", "TPS"]

HELP = "bytes per actor and step time, tp=2 against tp=1 (GPT and HF Llama, pp=2)"

TPS = (1, 2)


def add_arguments(p) -> None:
    p.add_argument("--models", default="gpt,llama", help="comma-separated: gpt, llama")
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--steps", type=int, default=4, help="measured steps per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.set_defaults(run=run)


def _gpt(args):
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, d_model=args.d_model, n_heads=4, n_layers=args.layers)
    return (lambda: gpt_stages(cfg, 2)), lm_loss


def _llama(args):
    import transformers

    from mpmd.planning import causal_lm_loss, split

    cfg = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=2 * args.d_model,
                                   num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=args.seq_len, tie_word_embeddings=False)

    def stages():
        torch.manual_seed(0)
        return split(transformers.LlamaForCausalLM(cfg), num_stages=2, verbose=False)

    return stages, causal_lm_loss


MODELS = {"gpt": _gpt, "llama": _llama}


def run(args) -> int:
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"bench tp: unknown model(s) {unknown}; choose from {sorted(MODELS)}")
    configs = [(m, tp) for m in models for tp in TPS]
    ensure_ray(sum(2 * tp for _, tp in configs))  # every configuration's actors at once
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=g) for _ in range(args.steps + 1)]
    held, whole = {}, {}
    with PipelineSet() as pipes:
        for model, tp in configs:
            make, loss_fn = MODELS[model](args)
            pipes[model, tp] = Pipeline(make(), schedule=args.schedule, num_microbatches=args.microbatches,
                                        loss_fn=loss_fn, device="cpu", tp=tp, tp_plan="auto" if tp > 1 else None,
                                        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4))
        for (model, tp), pipe in pipes.items():
            pipe.step(data[0], data[0])  # gradients and the optimizer state exist after a step
            held[model, tp] = pipe.engine.client.memory_bytes()
            if tp > 1:
                whole[model] = _whole_bytes(pipe)
        times = time_rounds(pipes, [(ids, ids) for ids in data[1:]], args.rounds).seconds
    _print(args, models, held, times, whole)
    return 0


def _whole_bytes(pipe) -> list:
    """Per pipeline rank: (bytes of the parameters the plan shards, bytes of those it leaves
    whole), counted on the controller's copy of the stages (whole tensors)."""
    out = []
    for r in range(pipe.num_ranks):
        sharded = replicated = 0
        for s in pipe.schedule.stages_of(r):
            stage, plan = pipe.engine.stages[s], pipe.engine.fleet.tp_plans[s]
            placed = param_placements(stage, plan if isinstance(plan, dict) else {})
            for name, p in stage.named_parameters():
                n = p.numel() * p.element_size()
                if placed.get(name, "Replicate()") not in ("Replicate()", None):
                    sharded += n
                else:
                    replicated += n
        out.append((sharded, replicated))
    return out


def _print(args, models, held, times, whole) -> None:
    print(f"pp=2, {args.schedule}, {args.microbatches} microbatches of {args.batch_size // args.microbatches}, "
          f"seq {args.seq_len}, d_model {args.d_model}, {args.layers} layers, vocab {args.vocab}, AdamW fp32 (CPU, "
          f"gloo); tp_plan='auto'; median of {args.steps * args.rounds} steps each")
    rows = []
    for model in models:
        for tp in TPS:
            t, t1 = statistics.median(times[model, tp]), statistics.median(times[model, 1])
            for r in range(2):
                group = held[model, tp][r * tp:(r + 1) * tp]  # dp=1: actor (r * tp + t)
                p, gr, o = (max(h[k] for h in group) for k in ("params", "grads", "optimizer"))
                p1 = held[model, 1][r]["params"]
                sharded, replicated = whole[model][r]
                here = p - replicated if tp > 1 else sharded
                rows.append((model, str(tp), str(r), f"{p / 2**10:.1f}", f"{gr / 2**10:.1f}", f"{o / 2**10:.1f}",
                             f"{here / 2**10:.1f}", f"{here / sharded:.3f}", f"{p / p1:.3f}", f"{t * 1e3:.1f}",
                             f"{t / t1:.2f}"))
    print_table(("model", "tp", "rank", "params KiB", "grads KiB", "optim KiB", "sharded KiB", "x tp1", "params x tp1",
                 "step ms", "x tp1"), rows)
    print("per pipeline rank, the largest actor of its TP group; sharded: the bytes of the parameters the plan "
          "shards (at tp=1 whole); x tp1: against tp=1's")
