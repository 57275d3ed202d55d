"""mpmd train's config: every bad config refused with one clear error before anything starts."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
import tomllib
import typing

import pytest

from mpmd.cli import main
from mpmd.lm import ConfigError, TrainConfig, check_pipeline, load_config, to_toml
from mpmd.lm.config import DEFAULT_STEP_TIMEOUT_S, ParallelConfig
from mpmd.lm.config_io import config_from_dict, parse_override
from mpmd.lm.recipe import LRSchedule, pipeline_options
from mpmd.runtime import PipelineConfig

REPO = pathlib.Path(__file__).resolve().parents[3]


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
    ("optim.clip_grad_norm=-1", r"optim.clip_grad_norm must be a finite number >= 0, got -1.0"),
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
    ("parallel.zero=2", r"parallel.zero = 2 is more than the maximum 1: 0 \(off\) or 1 \(ZeRO-1"),
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


def test_cli_refuses_before_anything_starts(capsys, monkeypatch):
    import ray

    # Ray may be up already (the session's fixture, for earlier tests): the refusals must not start it.
    started = ray.is_initialized()
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("the CLI started Ray before refusing"))
    assert main(["train", "configs/debug.toml", "--set", "optim.lrr=1"]) == 2
    assert "did you mean optim.lr?" in capsys.readouterr().err
    assert main(["train", "configs/debug.toml", "--set", "parallel.schedule=zbv", "--set", "parallel.stages=3"]) == 2
    assert "parallel: zbv" in capsys.readouterr().err
    assert ray.is_initialized() == started
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


# -- numbers (Note [numeric limits] in mpmd/runtime/limits.py) ---------------------------------------
@pytest.mark.parametrize("overrides, message", [
    (["optim.lr=nan"], r"optim.lr must be a finite number > 0, got nan"),
    (["optim.lr=inf"], r"optim.lr must be a finite number > 0, got inf"),
    (["optim.lr=-inf"], r"optim.lr must be a finite number > 0, got -inf"),
    (["model.rope_theta=nan"], r"model.rope_theta must be a finite number > 0 or None, got nan"),
    (["optim.min_lr_ratio=nan"], r"optim.min_lr_ratio must be a finite number in \[0, 1\], got nan"),
    (["optim.min_lr_ratio=1.5"], r"optim.min_lr_ratio must be a finite number in \[0, 1\], got 1.5"),
    (["optim.clip_grad_norm=inf"], r"optim.clip_grad_norm must be a finite number >= 0, got inf"),
    (["optim.beta1=nan"], r"optim.beta1 must be a finite number in \[0, 1\), got nan"),
    (["optim.eps=nan"], r"optim.eps must be a finite number > 0, got nan"),
    (["optim.weight_decay=nan"], r"optim.weight_decay must be a finite number >= 0, got nan"),
    (["data.val_fraction=nan"], r"data.val_fraction must be a finite number in \(0, 1\), got nan"),
    (["model.rms_norm_eps=inf"], r"model.rms_norm_eps must be a finite number > 0, got inf"),
    (["run.peak_flops=nan"], r"run.peak_flops must be a finite number in \(0, 1e\+18\] or None, got nan"),
    (["parallel.memory_limit_gb=nan"], r"parallel.memory_limit_gb must be a finite number in \(0, 1,048,576\]"),
    (["tokenizer.sample_mb=nan"], r"tokenizer.sample_mb must be a finite number in \[2\*\*-20, 16,384\]"),
    (["data.shuffle_seed=-1"], r"data.shuffle_seed must be an integer >= 0 \(at most 4,294,967,295\), got -1"),
    (["data.shuffle_seed=4294967296"], r"data.shuffle_seed = 4,294,967,296 is more than the maximum 4,294,967,295"),
    (["optim.seed=-1"], r"optim.seed must be an integer >= 0"),
    (["parallel.microbatches=131072", "optim.batch_size=131072"],
     r"parallel.microbatches = 131,072 is more than the maximum 65,536: the schedule lists every microbatch's "
     r"actions"),
    (["parallel.microbatches=1000000000"], r"parallel.microbatches = 1,000,000,000 is more than the maximum 65,536"),
    (["optim.batch_size=1000000000"], r"optim.batch_size = 1,000,000,000 is more than the maximum 1,048,576"),
    (["optim.steps=1e12"], r"optim.steps = 1,000,000,000,000 is more than the maximum 100,000,000"),
    (["model.num_layers=100000", "parallel.stages=2"], r"model.num_layers = 100,000 is more than the maximum 1,024"),
    (["model.vocab_size=1e9"], r"model.vocab_size = 1,000,000,000 is more than the maximum 2,097,152"),
    (["data.seq_len=2e9"], r"data.seq_len = 2,000,000,000 is more than the maximum 1,048,576"),
    (["data.workers=100000"], r"data.workers = 100,000 is more than the maximum 4,096"),
    (["parallel.dp=1000", "parallel.tp=100"], r"parallel.stages x dp x tp = 2 x 1000 x 100 = 200,000 actors is more "
                                              r"than the maximum 65,536"),
    (["parallel.step_timeout_s=nan"], r"parallel.step_timeout_s must be a finite number in \[0, 604,800\], got nan"),
    (["parallel.step_timeout_s=-5"], r"parallel.step_timeout_s must be a finite number in \[0, 604,800\], got -5"),
    (["parallel.step_timeout_s=1e9"], r"parallel.step_timeout_s = 1000000000.0 is more than the maximum 604,800"),
])
def test_bad_numbers_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/debug.toml", overrides)


def _number_fields():
    """(section, key, is an int) for every number of every config section."""
    out = []
    for section in dataclasses.fields(TrainConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = {hints[f.name]} | set(typing.get_args(hints[f.name]))
            if {int, float} & kinds:
                out.append((section.name, f.name, int in kinds))
    return out


NUMBER_FIELDS = _number_fields()


def test_every_number_field_is_enumerated():
    assert len(NUMBER_FIELDS) >= 40 and ("optim", "lr", False) in NUMBER_FIELDS
    assert ("parallel", "microbatches", True) in NUMBER_FIELDS and ("data", "shuffle_seed", True) in NUMBER_FIELDS


@pytest.mark.parametrize("section, key, integer", NUMBER_FIELDS, ids=[f"{s}.{k}" for s, k, _ in NUMBER_FIELDS])
def test_every_number_is_finite_and_bounded(section, key, integer):
    """Every number of every section, from TOML and from Python: NaN and the infinities refused,
    an integer's far too large value too, each naming its key."""
    name = rf"{section}\.{key}"
    cls = typing.get_type_hints(TrainConfig)[section]
    for value in [math.nan, math.inf, -math.inf, -1] + ([10 ** 30] if integer else []):
        with pytest.raises(ConfigError, match=name):
            config_from_dict({section: {key: value}})
        with pytest.raises(ValueError, match=name):
            cls(**{key: value})
    if integer:
        with pytest.raises(ValueError, match=name):
            cls(**{key: True})  # a bool is not a count


def test_flags_and_layers_are_typed_from_python():
    with pytest.raises(ValueError, match=r"parallel.compile must be true or false, got 1"):
        ParallelConfig(compile=1)
    with pytest.raises(ValueError, match=r"run.resume must be true or false, got 'no'"):
        dataclasses.replace(TrainConfig().run, resume="no")
    with pytest.raises(ValueError, match=r"parallel.layers must be \"equal\", \"balanced\" or a list of integers, "
                                         r"got \(1.5, 2.5\)"):
        ParallelConfig(layers=(1.5, 2.5))
    assert ParallelConfig(layers=[3, 1]).layers == (3, 1)


def test_the_largest_values_pass():
    cfg = load_config("configs/debug.toml", ["parallel.microbatches=65536", "optim.batch_size=65536",
                                             "data.shuffle_seed=4294967295", "optim.seed=4294967295",
                                             "parallel.step_timeout_s=0", "optim.clip_grad_norm=0",
                                             "optim.min_lr_ratio=1"])
    assert cfg.parallel.microbatches == 65536 and cfg.data.shuffle_seed == 2 ** 32 - 1


def test_a_billion_microbatches_dry_run_exits_at_once(capsys):
    """The dry run of a billion microbatches was a day building the schedule; it is refused at load."""
    start = time.perf_counter()
    code = main(["train", "configs/debug.toml", "--dry-run", "--set", "parallel.microbatches=1000000000",
                 "--set", "optim.batch_size=1000000000"])
    print(f"refused in {time.perf_counter() - start:.2f} s")  # measured, not asserted (CONVENTIONS 10)
    assert code == 2
    err = capsys.readouterr().err
    assert "optim.batch_size = 1,000,000,000 is more than the maximum 1,048,576" in err
    assert main(["train", "configs/debug.toml", "--dry-run", "--set", "parallel.microbatches=1000000000"]) == 2
    assert "parallel.microbatches = 1,000,000,000 is more than the maximum 65,536" in capsys.readouterr().err


def test_train_sets_a_step_timeout_by_default():
    """Note [train's step timeout]: 600 s unless parallel.step_timeout_s says otherwise; 0 is none."""
    cfg = load_config("configs/debug.toml")
    assert cfg.parallel.step_timeout_s == DEFAULT_STEP_TIMEOUT_S == 600.0
    options = pipeline_options(cfg.parallel, cfg.optim)
    assert options["step_timeout_s"] == 600.0
    assert PipelineConfig.from_options(step_timeout_s=options["step_timeout_s"]).dispatch.step_timeout_s == 600.0
    for override, expected in (("parallel.step_timeout_s=45", 45.0), ("parallel.step_timeout_s=0", None)):
        cfg = load_config("configs/debug.toml", [override])
        assert pipeline_options(cfg.parallel, cfg.optim)["step_timeout_s"] == expected
    assert "step_timeout_s = 600.0" in to_toml(load_config("configs/debug.toml"))


def test_the_dry_run_says_when_a_step_would_time_out():
    from mpmd.lm.dry_run import dry_run

    slow = dry_run(load_config("configs/debug.toml", ["run.peak_flops=1e3", "parallel.step_timeout_s=5"]))
    assert any("is longer than parallel.step_timeout_s = 5 s: every step would time out" in n for n in slow.notes)
    fast = dry_run(load_config("configs/debug.toml", ["run.peak_flops=1e15"]))
    assert not any("step_timeout_s" in n for n in fast.notes)
