"""Tests for ``python -m mpmd schedule`` (mpmd/cli/schedule.py)."""

from __future__ import annotations

import argparse

import pytest

import schedules
from mpmd.cli import schedule as schedule_cli
from mpmd.cli import main


def test_show_prints_grid_bubble_and_peaks(capsys):
    assert main(["schedule", "show", "1f1b", "--ranks", "4", "--microbatches", "8"]) == 0
    out = capsys.readouterr().out
    s = schedules.get_schedule("1f1b", 4, 8)
    assert s.render() in out
    assert "rank 0: 0F0 0F1 0F2 0F3 ..." in out
    assert "rank 3: ... ... ... 3F0 3B0" in out
    assert "bubble fraction (unit costs): 0.2727" in out  # 3 / 11
    assert "makespan (unit costs): 33" in out
    assert "peak activations per rank: 4, 3, 2, 1" in out
    assert "SEND" not in out  # the lowered program only with --lowered


def test_show_prints_a_split_schedule_as_a_pipeline_runs_it(capsys):
    assert main(["schedule", "show", "zbv", "-p", "2", "-m", "4"]) == 0
    out = capsys.readouterr().out
    runs = schedules.fuse_backwards(schedules.get_schedule("zbv", 2, 4))
    assert runs.render() in out and "one B (schedules/fuse.py)" in out
    assert schedules.get_schedule("zbv", 2, 4).render() not in out


def test_show_interleaved_with_stages_per_rank(capsys):
    assert main(["schedule", "show", "interleaved-1f1b", "-p", "2", "-m", "4", "-v", "2"]) == 0
    out = capsys.readouterr().out
    assert schedules.get_schedule("interleaved-1f1b", 2, 4, 2).render() in out
    assert "2 stage(s) per rank" in out
    assert "bubble fraction (unit costs): 0.1111" in out  # 1 / 9
    assert "peak activations per rank: 5, 3" in out


def test_show_lowered(capsys):
    assert main(["schedule", "show", "1f1b", "--ranks", "2", "--microbatches", "2", "--lowered"]) == 0
    out = capsys.readouterr().out
    assert "lowered program per rank:" in out
    assert "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0FREE0 0RECV_B1 0B1 0FREE1" in out
    assert "rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1FREE0 1F1 1B1 1SEND_B1 1FREE1" in out
    # The printed program parses back to the lowered schedule.
    lines = out.split("lowered program per rank:\n", 1)[1]
    assert schedules.Schedule.from_text(lines).ranks == schedules.lower(schedules.get_schedule("1f1b", 2, 2)).ranks


def test_show_lowered_with_tied_stages(capsys):
    assert main(["schedule", "show", "1f1b", "-p", "2", "-m", "2", "--tie", "0,1"]) == 0
    out = capsys.readouterr().out
    assert "rank 0: 0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0FREE0 0RECV_B1 0B1 0FREE1 0TIE_REDUCE0" in out
    assert "rank 1: 1RECV_F0 1F0 1RECV_F1 1B0 1SEND_B0 1FREE0 1F1 1B1 1SEND_B1 1FREE1 1TIE_REDUCE0" in out
    assert main(["schedule", "show", "1f1b", "-p", "2", "-m", "2", "--tie", "0,x"]) == 2
    assert "--tie takes stage numbers separated by commas, e.g. --tie 0,3; got '0,x'" in capsys.readouterr().err


def test_list(capsys):
    assert main(["schedule", "list"]) == 0
    out = capsys.readouterr().out
    for name in schedules.schedule_names():
        assert name in out
        assert schedules.schedule_info(name).description in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["show", "nope", "--ranks", "2", "--microbatches", "2"], "error: unknown schedule 'nope'; registered schedules: 1f1b"),
        (["show", "interleaved-1f1b", "--ranks", "4", "--microbatches", "6"], "must be divisible by num_ranks (4)"),
        (["show", "gpipe", "--ranks", "2", "--microbatches", "4", "--stages-per-rank", "2"], "gpipe needs stages_per_rank = 1"),
        (["show", "1f1b", "--ranks", "0", "--microbatches", "4"], "error: num_ranks must be a positive integer, got 0"),
    ],
)
def test_errors_exit_2(capsys, argv, message):
    assert main(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert message in captured.err
    assert captured.out == ""


def test_missing_subcommand_exits_2(capsys):
    assert main(["schedule"]) == 2
    assert "show or list" in capsys.readouterr().err


def test_missing_required_option_is_argparse_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["schedule", "show", "1f1b", "--ranks", "2"])
    assert info.value.code == 2
    assert "--microbatches" in capsys.readouterr().err


def test_add_parser_sets_run():
    parser = argparse.ArgumentParser()
    schedule_cli.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["schedule", "show", "gpipe", "--ranks", "2", "--microbatches", "3", "--lowered"])
    assert callable(args.run)
    assert (args.name, args.ranks, args.microbatches, args.stages_per_rank, args.lowered) == ("gpipe", 2, 3, None, True)
    assert callable(parser.parse_args(["schedule", "list"]).run)


def test_show_dualpipev_with_overlap_and_all_to_all(capsys):
    assert main(["schedule", "show", "dualpipev", "-p", "2", "-m", "8", "--overlap", "--a2a", "0.5", "--lowered"]) == 0
    out = capsys.readouterr().out
    assert schedules.fuse_backwards(schedules.get_schedule("dualpipev", 2, 8, overlap=True)).render() in out
    assert "0F3+3B1" in out and "makespan (unit costs): 49" in out  # unit costs: what the pairs cost in turn
    assert "without OVERLAP: 66\n  with OVERLAP: 54" in out  # docs/overlap.md's table
    assert main(["schedule", "show", "1f1b", "-p", "2", "-m", "4", "--overlap"]) == 2
    assert "1f1b has no overlapped forward-backward pairs" in capsys.readouterr().err
