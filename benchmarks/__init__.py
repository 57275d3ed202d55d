"""The benchmarks: ``python -m mpmd bench NAME [options]`` (``bench --list`` names them).
Each prints a table with ratios against a baseline measured in the same run.

Note [benchmarks outside the library]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The benchmarks are a package beside ``mpmd``, ``actors`` and ``schedules``, above them all:
they use the library as a user does (and some of its internals, to time them); nothing of
the library imports them, except ``mpmd/cli``'s ``main``, which imports them only when the
command is ``bench`` (tests/test_layout.py checks both).  So they never import ``mpmd.cli``
either: what they share with the CLI lives in the library (``mpmd.runtime.devices.ensure_ray``)
or is package data (the demo's text, ``harness.demo_text``).

    benches.py        the ``bench`` command: the benches by name, their listing, the old spellings
    harness.py        what the benches share: Ray for them, timed steps, alternating rounds, ratios, tables
    bench_config.py   the bench GPT and its options (bench steps, predict, auto)
    ckpt_baseline.py  the checkpoint path before sharding, bench ckpt's baseline
    sim_actors.py     simulated actors: step-channel endpoints without Ray (bench controller; the controller's
                      scale test)

  The benchmarks, one module each (python -m mpmd bench NAME):
    bench.py            steps: this runtime against one process and torch.distributed.pipelining
    bench_predict.py    predict: measured step time and bubble against the cost models
    bench_auto.py       auto: schedule='auto''s choice against its candidates
    bench_dispatch.py   dispatch: controller dispatch per actor, p = 2..16
    bench_controller.py controller: controller CPU per actor and step, up to 4,096 simulated actors
    bench_overhead.py   overhead: where each actor's step goes on tiny stages
    bench_versus.py     versus: every schedule against torch.distributed.pipelining
    bench_first.py      first: the first pipeline after ray.init against the next
    bench_fill.py       fill: PipeFill's cost to the main job
    bench_recipe.py     recipe: recompute and bf16 against fp32
    bench_memory.py     memory: bytes/param/actor and step time, zero=0 against zero=1
    bench_peaks.py      peaks: the memory model's predicted peak per actor against the measured one
    bench_tp.py         tp: bytes per actor and step time, tp=2 against tp=1 (GPT, HF Llama)
    bench_phases.py     phases: each process's peak memory by phase (build, save, load, export)
    bench_ckpt.py       ckpt: checkpoint save/load, through the controller against sharded
    bench_recovery.py   recovery: seconds from an actor's death to the next step, by phase
    bench_compile.py    compile: mpmd train's parallel.compile against eager
    bench_layers.py     layers: mpmd train's parallel.layers = "balanced" against equal layers
    bench_data.py       data: mpmd train's controller memory against corpus size
    bench_startup.py    startup: start-up per phase and per actor
"""

from .benches import BENCHES, add_parser, listing, old_spelling

__all__ = ["BENCHES", "add_parser", "listing", "old_spelling"]
