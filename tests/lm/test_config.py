"""mpmd train's config: every bad config refused with one clear error before anything starts."""

from __future__ import annotations

import dataclasses
import pathlib
import tomllib

import pytest

from mpmd.cli import main
from mpmd.lm import ConfigError, TrainConfig, check_pipeline, load_config, to_toml
from mpmd.lm.config_io import config_from_dict, parse_override
from mpmd.lm.recipe import LRSchedule

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_defaults_and_print_config_round_trip():
    cfg = load_config("configs/debug.toml")
    assert cfg.model.size == "debug" and cfg.parallel.stages == 2
    assert config_from_dict(tomllib.loads(to_toml(cfg))) == cfg
    for name in ("configs/125m.toml", "configs/llama3_8b.toml"):
        other = load_config(name)
        assert config_from_dict(tomllib.loads(to_toml(other))) == other


def test_overrides():
    cfg = load_config("configs/debug.toml", ["optim.lr=1e-3", "parallel.schedule=gpipe", "optim.steps=17",
                                             'data.train_files=["builtin:debug"]', "run.csv=false"])
    assert (cfg.optim.lr, cfg.parallel.schedule, cfg.optim.steps, cfg.run.csv) == (1e-3, "gpipe", 17, False)
    assert parse_override("run.dir=runs/x") == ("run", "dir", "runs/x")
    off = load_config("configs/debug.toml", ["optim.clip_grad_norm=0", "run.checkpoint_every=0"])
    assert config_from_dict(tomllib.loads(to_toml(off))) == off
    with pytest.raises(ConfigError, match="write section.key=value"):
        parse_override("lr=3")


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1e-3", r"unknown key optim.lrr; did you mean optim.lr\?"),
    ("parallel.microbatch=4", r"did you mean parallel.microbatches\?"),
    ("modle.size=1b", r"unknown section \[modle\]; did you mean model\?"),
    ("optim.lr=fast", r"configs/debug.toml: optim.lr must be a number, got 'fast'"),
    ("optim.clip_grad_norm=-1", r"optim.clip_grad_norm must be >= 0, got -1.0"),
    ("parallel.recompute=1", r"parallel.recompute must be true or false"),
    ("optim.steps=2.5", r"optim.steps must be an integer"),
    ("data.seq_len=512", r"data.seq_len \(512\) is larger than the model's positions \(model.max_position_"
                         r"embeddings = 256\)"),
    ("optim.batch_size=10", r"optim.batch_size \(10\) must be divisible by parallel.microbatches x parallel.dp "
                            r"\(4 x 1 = 4\); use e.g. 4, 8, 12"),
    ("data.train_files=[\"no/such/*.txt\"]", r"'no/such/\*.txt' matches no file"),
    ("tokenizer.path=\"missing.json\"", r"tokenizer.path = 'missing.json': no such file"),
    ("model.size=huge", r"model.size = 'huge' is not one of 'debug', '125m', '1b', '8b'"),
    ("parallel.stages=8", r"parallel.stages \(8\) is more than the model's 4 layers"),
    ("parallel.schedule=1f2b", r"parallel.schedule: unknown schedule '1f2b'"),
    ("optim.warmup_steps=500", r"optim.warmup_steps \(500\) is more than optim.steps \(300\)"),
    ("parallel.zero=2", r"parallel.zero = 2 is not one of 0, 1"),
    ("parallel.zero=1", r"parallel.zero = 1 splits the optimizer state over the dp replicas, but parallel.dp is 1"),
    ("model.num_kv_heads=3", r"model.num_heads \(4\) must be divisible by model.num_kv_heads \(3\)"),
])
def test_bad_configs_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", [override])


def test_schedule_against_stages_is_refused_before_actors():
    cfg = load_config("configs/debug.toml", ["parallel.schedule=zbv", "parallel.stages=3"])
    with pytest.raises(ValueError, match="parallel: zbv puts 2 stages on each actor, but 3 stages were given"):
        check_pipeline(cfg)


def test_compile_is_checked():
    with pytest.raises(ConfigError, match="parallel.compile_backend = 'nope' is not one of"):
        load_config("configs/debug.toml", ["parallel.compile=true", "parallel.compile_backend=nope"])
    cfg = load_config("configs/debug.toml", ["parallel.compile=true", "parallel.schedule=zb-h1"])
    with pytest.raises(ValueError, match="parallel.compile with parallel.schedule = 'zb-h1' is refused: that "
                                         "schedule splits the backward"):
        check_pipeline(cfg)
    with pytest.raises(ValueError, match="parallel.compile with parallel.schedule = \"auto\" is refused"):
        check_pipeline(load_config("configs/debug.toml", ["parallel.compile=true", "parallel.schedule=auto"]))
    check_pipeline(load_config("configs/debug.toml", ["parallel.compile=true"]))


def test_cli_refuses_before_anything_starts(capsys):
    import ray

    assert main(["train", "configs/debug.toml", "--set", "optim.lrr=1"]) == 2
    assert "did you mean optim.lr?" in capsys.readouterr().err
    assert main(["train", "configs/debug.toml", "--set", "parallel.schedule=zbv", "--set", "parallel.stages=3"]) == 2
    assert "parallel: zbv" in capsys.readouterr().err
    assert not ray.is_initialized()
    assert main(["train", "configs/debug.toml", "--print-config", "--set", "optim.lr=0.01"]) == 0
    assert "lr = 0.01" in capsys.readouterr().out


def test_lr_schedule_warmup_then_cosine_to_the_floor():
    cfg = dataclasses.replace(TrainConfig().optim, steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lr = LRSchedule.of(cfg)
    assert [round(lr(s), 12) for s in range(3)] == [0.1, 0.2, 0.3]
    assert lr(9) == 1.0 and lr(10) == 1.0
    assert abs(lr(60) - (0.1 + 0.9 * 0.5)) < 1e-12  # half-way through the decay: cos(pi/2) = 0
    assert abs(lr(110) - 0.1) < 1e-12
    linear = LRSchedule.of(dataclasses.replace(cfg, decay="linear"))
    assert abs(linear(35) - (0.1 + 0.9 * 0.75)) < 1e-12


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.toml")))
def test_every_shipped_config_starts(path):
    """What the run refuses before it starts, for every config we ship; and the dry run refuses it too."""
    cfg = load_config(str(REPO / path))
    check_pipeline(cfg)


def test_the_dry_run_refuses_what_the_run_would():
    from mpmd.lm.dry_run import dry_run

    cfg = load_config(str(REPO / "configs/llama3_8b.toml"), ["parallel.compile=true"])
    with pytest.raises(ValueError, match=r"parallel.compile with parallel.schedule = 'dualpipev' is refused"):
        dry_run(cfg)
