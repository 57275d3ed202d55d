"""``python -m mpmd bench NAME``: one command for every benchmark, its listing, the old
spellings' errors naming the new ones, and the harness the benches share.  Nothing here
starts Ray or runs a bench."""

from __future__ import annotations

import random

import pytest

from benchmarks.bench_config import config_from_args
from benchmarks.bench_first import round_command
from benchmarks.benches import BENCHES, old_spelling
from benchmarks.harness import PipelineSet, median_ratio, ratios_text, time_rounds
from mpmd.cli import build_parser, main

# The subcommands before one `bench` held them (bench-NAME), and the plain bench's modes.
FORMER = ("compile", "fill", "recipe", "dispatch", "ckpt", "memory", "first", "recovery", "tp", "phases")


def test_help_shows_one_bench_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "bench-" not in out
    for command in ("train", "demo", "schedule", "bench", "profile", "export"):
        assert command in out


def test_bench_list_names_every_bench_with_what_it_measures(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "--list"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert set(BENCHES) == {"steps", "predict", "auto", "peaks", "data", "overhead", "versus", "layers", "controller",
                            "startup", "moe", "context", *FORMER}
    for name, module in BENCHES.items():
        assert f"  {name} " in out and module.HELP in out


def test_bench_without_a_name_lists_the_names_and_fails(capsys):
    assert main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "name a benchmark" in err and all(f"  {name} " in err for name in BENCHES)


def test_an_unknown_bench_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", "nope"])
    assert e.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_has_its_help(name, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", name, "--help"])
    assert e.value.code == 0
    assert f"python -m mpmd bench {name}" in capsys.readouterr().out


@pytest.mark.parametrize("argv, new", [
    (["bench-ckpt", "--params", "1e6"], "python -m mpmd bench ckpt --params 1e6"),
    (["bench", "--auto", "--measure-all", "6"], "python -m mpmd bench auto --measure-all 6"),
    (["bench", "--schedule", "zbv", "--predict"], "python -m mpmd bench predict --schedule zbv"),
    (["bench", "--schedule", "1f1b", "--no-torch"], "python -m mpmd bench steps --schedule 1f1b --no-torch"),
])
def test_an_old_spelling_fails_naming_the_new_one(argv, new, capsys):
    assert main(argv) == 2
    assert f"use: {new}" in capsys.readouterr().err


@pytest.mark.parametrize("name", FORMER)
def test_every_former_subcommand_has_a_bench_name(name):
    assert name in BENCHES
    assert old_spelling([f"bench-{name}"]).endswith(f"use: python -m mpmd bench {name}")


def test_new_spellings_are_not_taken_for_old_ones():
    for argv in (["bench"], ["bench", "--list"], ["bench", "-h"], ["bench", "steps", "--no-torch"], ["demo"], []):
        assert old_spelling(argv) is None
    assert "bench --list" in old_spelling(["bench-nope"])


def test_bench_first_starts_its_rounds_with_the_new_spelling():
    args = build_parser(benches=True).parse_args(["bench", "first", "--steps", "5", "--actors", "2", "4"])
    child = build_parser(benches=True).parse_args(round_command(args, "settled")[3:])
    assert (child.bench, child.round, child.steps, child.actors) == ("first", "settled", 5, [2, 4])


def test_bench_config_options_and_refusals(capsys):
    parser = build_parser(benches=True)
    args = parser.parse_args(["bench", "steps", "--schedule", "1f1b,zbv", "--layers", "8", "-m", "4"])
    cfg = config_from_args(args, rounds=2)
    assert (cfg.schedules, cfg.n_layers, cfg.microbatches, cfg.rounds) == (("1f1b", "zbv"), 8, 4, 2)
    auto = parser.parse_args(["bench", "auto", "--actors", "4", "--measure-all", "3"])
    assert config_from_args(auto, schedules=(), microbatches=1).actors == 4 and auto.measure_all == 3
    bad = parser.parse_args(["bench", "steps", "-m", "3"])
    assert config_from_args(bad) is None
    assert "batch_size (32) must be divisible by microbatches (3)" in capsys.readouterr().err
    assert main(["bench", "predict", "--schedule", "nope"]) == 2


class _FakePipe:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log, self.closed = name, log, False

    def step(self, x, y) -> float:
        self.log.append((self.name, x))
        return float(x)

    def shutdown(self) -> None:
        self.closed = True


def test_time_rounds_alternates_the_pipelines_and_times_every_step():
    log: list = []
    pipes = {"a": _FakePipe("a", log), "b": _FakePipe("b", log)}
    seconds, losses = time_rounds(pipes, [(1, 0), (2, 0)], rounds=2)
    assert log == [("a", 1), ("a", 2), ("b", 1), ("b", 2)] * 2
    assert losses == {"a": [1.0, 2.0, 1.0, 2.0], "b": [1.0, 2.0, 1.0, 2.0]}
    assert all(len(s) == 4 and min(s) >= 0 for s in seconds.values())

    log.clear()
    rounds = time_rounds(pipes, lambda key: [(3, 0)] if key == "a" else [(4, 0)], rounds=3,
                         shuffle=random.Random(0), untimed_first=True)
    assert sorted(log) == sorted([("a", 3)] * 6 + [("b", 4)] * 6)  # each turn: one untimed step, one timed
    assert rounds.losses == {"a": [3.0] * 3, "b": [4.0] * 3}


def test_pipeline_set_shuts_every_pipeline_down_on_error():
    pipes = {}
    with pytest.raises(RuntimeError, match="boom"):
        with PipelineSet() as pipes:
            pipes["a"], pipes["b"] = _FakePipe("a", []), _FakePipe("b", [])
            raise RuntimeError("boom")
    assert all(p.closed for p in pipes.values())


def test_paired_ratios():
    assert median_ratio([2.0, 3.0, 10.0], [1.0, 1.0, 1.0]) == 3.0
    assert ratios_text([1.0, 0.975]) == "1.00x, 0.97x"
