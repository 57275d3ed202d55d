"""``python -m mpmd bench phases``: what each process holds, phase by phase, measured by the
kernel, for a Llama from ``mpmd train``'s factories at pp=2 x tp=2 (AdamW).

Each actor's **peak resident size** (Linux ``VmHWM``, restarted before each phase through
``/proc/self/clear_refs``) is reported above its resident size before the phase, as a
multiple of its *share*: its shard's parameters, gradients and optimizer state.  Build is
the transient of making the stage (the peak after set-up above what stays).  The
controller's growth is reported as a fraction of the model's bytes.  In the same run, the
paths that move whole tensors are measured beside the ones that do not:

* build: a factory that builds its shards directly (Note [sharded build]) against one built
  whole and sliced (the same factory with ``build_sharded`` hidden), two pipelines;
* steps: training steps once AdamW's state exists (activations, gradients);
* save / load: a checkpoint, each TP rank writing and reading its pieces (Note [checkpoint
  pieces]);
* export: the actors writing safetensors (Note [export from the actors]) against
  ``pipe.state_dict()`` (the whole model to the controller);
* weights in: ``load_safetensors`` (each actor its part) against ``load_state_dict`` of the
  whole model (the controller holds it, Ray's object store a copy per stage).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from mpmd.pipeline import Pipeline
from .harness import ensure_ray, print_table, rss_bytes

__all__ = ["HELP", "add_arguments", "run"]

HELP = "each process's peak memory per phase (build, save, load, export), as a multiple of its share, pp=2 x tp=2"


def add_arguments(p) -> None:
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=32)
    p.set_defaults(run=run)


class _Controller:
    """This process's peak resident growth over a phase (VmHWM restarted first)."""

    def __init__(self) -> None:
        self.before = 0  # resident bytes at __enter__
        self.growth = 0  # peak resident growth in bytes, set by __exit__

    def __enter__(self):
        from actors.probes import reset_peak_rss

        reset_peak_rss()
        self.before = rss_bytes()
        return self

    def __exit__(self, *exc) -> None:
        from actors.probes import peak_rss_bytes

        self.growth = peak_rss_bytes() - self.before


def _phase(pipe, work) -> tuple[list[float], int]:
    """(each actor's peak growth during ``work()`` / its share, the controller's growth in bytes)."""
    before = pipe.engine.client.memory_stats(reset=True, what="memory")
    with _Controller() as controller:
        work()
    after = pipe.engine.client.memory_stats(what="memory")
    return [(a["peak_rss_bytes"] - b["rss_bytes"]) / _share(b) for a, b in zip(after, before)], controller.growth


def _share(m: dict) -> int:
    return m["params_bytes"] + m["grads_bytes"] + m["optimizer_bytes"]


@dataclasses.dataclass(frozen=True)
class _WholeBuild:
    """A factory built whole and then sliced: ``build_sharded`` is not offered."""

    factory: object

    def __call__(self):
        return self.factory()


def run(args) -> int:
    from mpmd.lm.config import ModelConfig, OptimConfig
    from mpmd.lm.models import stage_factories, llama_spec
    from mpmd.lm.recipe import AdamWFactory
    from mpmd.planning import causal_lm_loss

    if not os.path.exists("/proc/self/clear_refs"):
        print("bench phases: the kernel's peak resident size (VmHWM, /proc/self/clear_refs) is Linux only")
        return 2
    ensure_ray(8)
    heads = max(4, args.hidden // 64)
    spec = llama_spec(ModelConfig(size="debug", hidden_size=args.hidden, num_layers=args.layers, num_heads=heads,
                                  num_kv_heads=heads // 2, intermediate_size=4 * args.hidden,
                                  max_position_embeddings=args.seq_len), args.vocab)
    factories = stage_factories(spec, 2, args.seq_len)
    options = dict(schedule="1f1b", tp=2, tp_plan="auto", num_microbatches=2, loss_fn=causal_lm_loss,
                   optimizer=AdamWFactory(OptimConfig()), device="cpu", num_cpus=0.5)
    g = torch.Generator().manual_seed(0)
    x, y = (torch.randint(0, args.vocab, (4, args.seq_len), generator=g) for _ in range(2))
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, stages in (("whole", [_WholeBuild(f) for f in factories]), ("sharded", factories)):
            with Pipeline(stages, **options) as pipe:
                stats = pipe.engine.client.memory_stats(what="memory")
                pipe.step(x, y)  # AdamW's state exists: the share is whole
                shares = pipe.engine.client.memory_stats(what="memory")
                model_bytes = sum(m["params_bytes"] for m in shares)
                rows[f"build ({name})"] = ([(m["peak_rss_bytes"] - m["rss_bytes"]) / _share(s)
                                            for m, s in zip(stats, shares)], None)
                if name == "whole":
                    continue
                rows["steps (3)"] = _phase(pipe, lambda: [pipe.step(x, y) for _ in range(3)])
                rows["save"] = _phase(pipe, lambda: pipe.save(os.path.join(tmp, "ck")))
                rows["load"] = _phase(pipe, lambda: pipe.load(os.path.join(tmp, "ck")))
                rows["export (actors)"] = _phase(pipe, lambda: pipe.export_safetensors(os.path.join(tmp, "hf")))
                state = {}
                rows["state_dict (controller)"] = _phase(pipe, lambda: state.update(pipe.state_dict()))
                rows["load_safetensors (actors)"] = _phase(pipe, lambda: pipe.load_safetensors(os.path.join(tmp, "hf")))
                rows["load_state_dict (controller)"] = _phase(pipe, lambda: pipe.load_state_dict(state))
                state.clear()
    print(f"bench phases: Llama {model_bytes / 2**20:.0f} MiB of fp32 weights (hidden {args.hidden}, "
          f"{args.layers} layers, vocab {args.vocab}) at pp=2 x tp=2, AdamW; peak resident growth by the kernel")
    print_table(("phase", "actors: peak growth / share", "controller: growth / model"),
                [(phase, " ".join(f"{r:5.2f}" for r in actors), "" if controller is None else
                  f"{controller / model_bytes:.2f}") for phase, (actors, controller) in rows.items()])
    return 0
