"""Bad input gets an error that names the stage and what it expected and got; a
non-finite loss raises with the step (or is skipped exactly); Ctrl-C tears down."""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd

from mpmd.runtime import FLAT_OPTIONS, PipelineConfig, check_microbatches
from mpmd.runtime import config as config_module
from mpmd.runtime.config import MAX_MICROBATCHES, MAX_SEED

from tests.models import Embed, Head, adamw, make_data, make_stages

MICROBATCHES = 2
DATA = make_data(4, 8)  # inputs (8, 6) float32, targets (8, 3)


def equal_states(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def new_pipeline(stages=None, **options):
    return mpmd.Pipeline(stages if stages is not None else make_stages(2), schedule="1f1b",
                         num_microbatches=MICROBATCHES, loss_fn=F.mse_loss, optimizer=adamw, device="cpu",
                         **options)


@pytest.fixture(scope="module")
def pipe(ray_session):
    p = new_pipeline()
    p.step(*DATA[0])  # the first step sets what the first stage expects
    yield p
    p.shutdown()


def test_a_batch_that_does_not_split_into_microbatches(pipe):
    x, y = DATA[0]
    with pytest.raises(ValueError, match=r"inputs has batch size 7, which does not split into 2 equal microbatches "
                                         r"\(num_microbatches=2 x dp=1\); use a batch size divisible by 2, e.g. 6 or 8"):
        pipe.step(x[:7], y[:7])
    with pytest.raises(ValueError, match=r"targets has batch size 5, which does not split into 2 equal microbatches"):
        pipe.step(x[:6], torch.zeros(5, 3))


def test_empty_data(pipe):
    with pytest.raises(ValueError, match=r"fit got no batches: data is empty"):
        pipe.fit([], progress=False)
    once = (b for b in DATA[:1])
    with pytest.raises(ValueError, match=r"no batches in epoch 2: data gave batches once and is now exhausted"):
        pipe.fit(once, epochs=2, progress=False)


def test_a_wrong_dtype_or_structure_is_refused_before_dispatch(pipe):
    x, y = DATA[1]
    rpcs = pipe.last_step_rpcs
    with pytest.raises(ValueError, match=r"stage 0 \(Embed\) expects inputs like the first step's: \(4, 6\) float32 "
                                         r"per microbatch, but got \(4, 6\) float64"):
        pipe.step(x.double(), y)
    with pytest.raises(ValueError, match=r"stage 0 \(Embed\) expects .* \(4, 6\) float32 per microbatch, but got "
                                         r"\(\(4, 6\) float32, \(4, 6\) float32\)"):
        pipe.step((x, x), y)
    with pytest.raises(ValueError, match=r"expects .*\(4, 6\) float32 per microbatch, but got \(4, 6, 1\) float32"):
        pipe.step(x[..., None], y)
    assert pipe.last_step_rpcs == rpcs
    pipe.step(x, y)  # refused before dispatch: the pipeline is still usable


def test_a_nonfinite_loss_raises_with_the_step(pipe):
    x, y = DATA[2]
    before = pipe.state_dict()
    with pytest.raises(FloatingPointError, match=r"step \d+: the loss is inf \(microbatch losses: inf, inf\); no "
                                                 r"actor applied the step.*on_nan='skip'") as info:
        pipe.fit([(x, torch.full_like(y, 1e30))], progress=False)
    step = info.value.step
    assert f"step {step}:" in str(info.value)
    after = pipe.state_dict()  # the actors agreed not to apply it (Note [agreed update])
    assert all(torch.equal(before[k], after[k]) for k in before)
    bad = x.clone()
    bad[5, 2] = float("nan")  # in the second microbatch
    with pytest.raises(FloatingPointError, match=rf"step {step + 1}: the loss is nan \(microbatch losses: "
                                                 r"[0-9.e+]+, nan\)"):
        pipe.step(bad, y)


def test_a_wrong_shape_names_the_stage_expected_and_got(pipe):
    """Last in this file's use of ``pipe``: an error inside an actor tears the pipeline down."""
    x, y = DATA[3]
    with pytest.raises(mpmd.StageFailedError, match=r"(?s)stage 0 \(Embed\) failed on the step's inputs: got "
                                                    r"\(4, 5\) float32 per microbatch, expected \(4, 6\) float32 as in "
                                                    r"the first step.*mat1 and mat2 shapes cannot be multiplied "
                                                    r"\(4x5 and 6x8\)"):
        pipe.step(x[:, :5], y)
    assert pipe.actors == []


def test_a_stage_output_that_does_not_fit_the_next_stage(ray_session):
    x, y = DATA[0]
    pipe = new_pipeline([Embed(6, 8), Head(5, 3)])
    try:
        with pytest.raises(mpmd.StageFailedError, match=r"(?s)stage 1 \(Head\) failed on the output of stage 0 "
                                                        r"\(Embed\).*step 0.*its input \(the output of stage 0\): "
                                                        r"\(4, 8\) float32") as info:
            pipe.step(x, y)
        assert (info.value.stage, info.value.step) == (1, 0)
    finally:
        pipe.shutdown()


def _elementwise_mse(out, target):
    return (out - target) ** 2  # forgot the reduction


@pytest.mark.parametrize("loss_fn, target_cols, culprit", [
    (F.mse_loss, 2, r"loss_fn mse_loss raised RuntimeError: The size of tensor a \(3\) must match the size of "
                    r"tensor b \(2\)"),
    (_elementwise_mse, 3, r"loss_fn _elementwise_mse returned a tensor of shape \(4, 3\), not a scalar: reduce it"),
])
def test_a_failing_loss_fn_is_named_with_the_output_and_targets_it_got(ray_session, loss_fn, target_cols, culprit):
    """A wrong-shaped target, or a loss that is not reduced: the error names loss_fn and what it
    got, not the stage boundary before it (stage 1 ran fine)."""
    x, y = DATA[0]
    pipe = mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=MICROBATCHES, loss_fn=loss_fn,
                         optimizer=adamw, device="cpu")
    try:
        with pytest.raises(mpmd.StageFailedError) as info:
            pipe.step(x, torch.zeros(8, target_cols))
    finally:
        pipe.shutdown()
    message = str(info.value).split("actor traceback:")[0]
    assert re.match(r"loss_fn failed on the output of stage 1 \(\w+\), the last stage, and the targets", message)
    assert re.search(culprit, message), message
    assert re.search(rf"the last stage's output: \(4, 3\) float32; the targets: \(4, {target_cols}\) float32",
                     message), message
    assert "does not fit" not in message and "its input" not in message
    assert info.value.in_loss and info.value.stage == 1


@pytest.fixture(scope="module")
def skipping(ray_session):
    p = new_pipeline(on_nan="skip")
    yield p
    p.shutdown()


def test_on_nan_skip_leaves_parameters_and_optimizer_state_unchanged(skipping, tmp_path):
    (x0, y0), (x1, y1), (x2, y2) = DATA[:3]
    skipping.step(x0, y0)
    before = skipping.state_dict()
    saved = skipping.save(tmp_path / "before")
    bad = y1.clone()
    bad[0, 0] = float("inf")
    with pytest.warns(UserWarning, match=r"step 1: the loss is inf; skipped it"):
        loss = skipping.step(x1, bad)
    assert loss == float("inf") and skipping.skipped_steps == [1]
    assert equal_states(skipping.state_dict(), before)
    skipping.step(x2, y2)
    after_skip = skipping.state_dict()
    # The same good step straight from the saved state: equal only if the skip left the
    # optimizer's state (AdamW's step count and moments) as it was too.
    skipping.load(saved)
    skipping.step(x2, y2)
    assert equal_states(skipping.state_dict(), after_skip)
    with pytest.raises(ValueError, match=r"on_nan must be 'raise' or 'skip', got 'ignore'"):
        new_pipeline(on_nan="ignore")


def test_ctrl_c_during_fit_tears_the_actors_down_and_leaves_ray_running(skipping, monkeypatch):
    from mpmd.runtime.channels import Channels

    handles = list(skipping.actors)
    real_poll = Channels.poll

    def interrupted(*args, **kwargs):  # Ctrl-C while the controller waits for a step's actors
        monkeypatch.setattr(Channels, "poll", real_poll)
        raise KeyboardInterrupt

    # The step's results come over the step channels (Note [step channel]); every wait polls them.
    monkeypatch.setattr(Channels, "poll", interrupted)
    with pytest.raises(KeyboardInterrupt):
        skipping.fit(DATA, progress=False)
    assert skipping.actors == []
    for handle in handles:
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(handle.pid.remote(), timeout=60)
    assert ray.is_initialized() and ray.get(ray.put(7)) == 7
    with pytest.raises(RuntimeError, match="shut down"):
        skipping.step(*DATA[0])


# -- PipelineConfig's numbers (Note [numeric limits] in mpmd/runtime/limits.py); no actors ----------
NAN, INF = math.nan, math.inf


@pytest.mark.parametrize("options, message", [
    (dict(comm_timeout_s=NAN), r"comm_timeout_s must be a finite number in \(0, 604,800\], got nan"),
    (dict(comm_timeout_s=INF), r"comm_timeout_s must be a finite number in \(0, 604,800\], got inf"),
    (dict(comm_timeout_s=0), r"comm_timeout_s must be a finite number in \(0, 604,800\], got 0"),
    (dict(comm_timeout_s=1e300), r"comm_timeout_s = 1e\+300 is more than the maximum 604,800: a week"),
    (dict(step_timeout_s=-5), r"step_timeout_s must be a finite number in \(0, 604,800\] or None, got -5"),
    (dict(step_timeout_s=NAN), r"step_timeout_s must be .* or None, got nan"),
    (dict(step_timeout_s=INF), r"step_timeout_s must be .* or None, got inf"),
    (dict(num_microbatches=10 ** 9), r"num_microbatches = 1,000,000,000 is more than the maximum 65,536: a schedule "
                                     r"lists every microbatch's actions"),
    (dict(num_microbatches=True), r"num_microbatches must be a positive integer or 'auto', got True"),
    (dict(num_cpus=NAN), r"num_cpus must be a finite number in \[0, 4,096\], got nan"),
    (dict(num_cpus=-1), r"num_cpus must be a finite number in \[0, 4,096\], got -1"),
    (dict(num_cpus=10 ** 9), r"num_cpus = 1,000,000,000 is more than the maximum 4,096"),
    (dict(num_gpus=NAN), r"num_gpus must be a finite number in \[0, 64\] or None, got nan"),
    (dict(bucket_bytes=1.5), r"bucket_bytes must be an integer >= 0 \(at most 1,099,511,627,776\), got 1.5"),
    (dict(bucket_bytes=True), r"bucket_bytes must be an integer >= 0 .*, got True"),
    (dict(bucket_bytes=-1), r"bucket_bytes must be an integer >= 0 .*, got -1"),
    (dict(bucket_bytes=2 ** 41), r"bucket_bytes = 2,199,023,255,552 is more than the maximum 1,099,511,627,776"),
    (dict(seed=-1), r"seed must be an integer >= 0 \(at most 4,294,967,295\), got -1"),
    (dict(seed=2 ** 32), r"seed = 4,294,967,296 is more than the maximum 4,294,967,295: numpy seeds"),
    (dict(seed=True), r"seed must be an integer >= 0 .*, got True"),
    (dict(seed=1.0), r"seed must be an integer >= 0 .*, got 1.0"),
    (dict(memory_limit_bytes=NAN), r"memory_limit_bytes must be > 0 \(per actor, for schedule='auto'\), got nan"),
    (dict(memory_limit_bytes=INF), r"memory_limit_bytes must be a finite number in \(0, 1,125,899,906,842,624\]"),
    (dict(memory_limit_bytes=2 ** 51), r"memory_limit_bytes = 2,251,799,813,685,248 is more than the maximum"),
    (dict(memory_limit_bytes=True), r"memory_limit_bytes must be > 0 .*, got True"),
    (dict(clip_grad_norm=NAN), r"clip_grad_norm must be a finite number > 0 or None, got nan"),
    (dict(clip_grad_norm=INF), r"clip_grad_norm must be a finite number > 0 or None, got inf"),
    (dict(clip_grad_norm=0), r"clip_grad_norm must be a finite number > 0 or None, got 0"),
    (dict(clip_norm_type=NAN), r"clip_norm_type must be a number > 0 or inf, got nan"),
    (dict(clip_norm_type=-INF), r"clip_norm_type must be a number > 0 or inf, got -inf"),
    (dict(spare_actors=10 ** 9), r"spare_actors = 1,000,000,000 is more than the maximum 65,536"),
    (dict(dp=10 ** 9), r"dp = 1,000,000,000 is more than the maximum 65,536: data-parallel replicas"),
    (dict(dp=True), r"dp must be a positive integer \(at most 65,536\), got True"),
    (dict(tp=10 ** 9, tp_plan="auto"), r"tp = 1,000,000,000 is more than the maximum 65,536"),
    (dict(tp=(1, 10 ** 9), tp_plan="auto"), r"tp = 1,000,000,000 is more than the maximum 65,536"),
    (dict(num_actors=10 ** 9), r"num_actors = 1,000,000,000 is more than the maximum 65,536"),
    (dict(num_actors=1000, dp=1000), r"num_actors x dp x tp = 1000 x 1000 x 1 = 1,000,000 actors is more than the "
                                     r"maximum 65,536"),
    (dict(overlap_reduce=1), r"overlap_reduce must be True or False, got 1"),
    (dict(dynamic_shapes="yes"), r"dynamic_shapes must be True or False, got 'yes'"),
    (dict(seed=-10 ** 50), r"seed must be an integer >= 0 .*, got -10000000000...\(51 digits\)"),
])
def test_bad_numbers_are_refused_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        if "num_microbatches" in options:  # the schedule's, checked as asked before it is built
            check_microbatches(options["num_microbatches"])
        else:
            PipelineConfig.from_options(**options)


def test_bad_numbers_are_refused_by_the_pipeline_before_anything_starts():
    with pytest.raises(ValueError, match=r"comm_timeout_s must be a finite number in \(0, 604,800\], got nan"):
        new_pipeline(comm_timeout_s=float("nan"))
    with pytest.raises(ValueError, match=r"num_microbatches = 1,000,000,000 is more than the maximum 65,536"):
        mpmd.Pipeline(make_stages(2), num_microbatches=10 ** 9, loss_fn=F.mse_loss, optimizer=adamw, device="cpu")


def _number_options():
    """Pipeline's keywords (Note [flat options]) whose field in their group takes a number."""
    groups = {f.name: f.type for f in dataclasses.fields(PipelineConfig)}
    hints = {g: typing.get_type_hints(getattr(config_module, groups[g])) for g in groups}
    return [k for k, (g, f) in FLAT_OPTIONS.items() if {int, float} & ({hints[g][f]} | set(typing.get_args(hints[g][f])))]


@pytest.mark.parametrize("name", _number_options())
def test_every_number_option_refuses_nan(name):
    """Every option that takes a number, NaN and -inf refused naming it (Note [numeric limits])."""
    for value in (math.nan, -math.inf):
        with pytest.raises(ValueError, match=rf"^{name}\b"):
            PipelineConfig.from_options(**{name: value})


def test_the_edges_of_the_ranges_pass():
    cfg = PipelineConfig.from_options(seed=MAX_SEED, clip_norm_type=math.inf, clip_grad_norm=1, num_cpus=0,
                                      num_gpus=0.5, bucket_bytes=0, step_timeout_s=None, comm_timeout_s=1e-3,
                                      memory_limit_bytes=1e9, spare_actors=0, num_actors=2, dp=2)
    check_microbatches(MAX_MICROBATCHES)
    check_microbatches("auto")
    assert (cfg.recipe.seed, cfg.recipe.clip_norm_type) == (2 ** 32 - 1, math.inf)
    assert PipelineConfig.from_options(tp=(1, 2), tp_plan="auto").layout.tp == (1, 2)


def test_each_flat_option_has_one_home_in_a_group():
    """Note [flat options]: Pipeline's keywords each land in one group's field and read back; the
    config holds no microbatch count (the schedule does) and at most 8 groups."""
    assert len(dataclasses.fields(PipelineConfig)) <= 8
    assert len(set(FLAT_OPTIONS.values())) == len(FLAT_OPTIONS) and "num_microbatches" not in FLAT_OPTIONS
    given = dict(num_actors=2, dp=3, zero=1, tp=2, tp_plan="auto", loss_parallel=True, address="ray://x:1",
                 device="cpu", num_cpus=2.0, num_gpus=0.5, placement="spread", spare_actors=1, fusion="none",
                 step_channel=False, step_timeout_s=9.0, transport="gloo", bucket_bytes=7, overlap_reduce=False,
                 comm_timeout_s=8.0, dynamic_shapes=True, seed=5, precision="bf16", clip_grad_norm=1.0,
                 clip_norm_type=1.0, recompute=(0,), on_nan="skip", memory_limit_bytes=1 << 20, auto_calibrate=False,
                 ep=1, overlap=False, moe_aux_loss_coef=0.5, moe_bias_update_rate=0.0, cp=1, document_mask=True)  # ep > 1 with tp, the bias step with recompute: refused
    assert set(given) == set(FLAT_OPTIONS)
    cfg = PipelineConfig.from_options(**given)
    assert {k: cfg.option(k) for k in given} == given
    assert (cfg.layout.pp, cfg.comm.timeout_s, cfg.planning.choose_zero) == (2, 8.0, False)
    assert PipelineConfig.from_options().planning.choose_zero  # zero not given: the planner may choose it
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_actor'"):
        PipelineConfig.from_options(num_actor=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'num_microbatches'"):
        PipelineConfig.from_options(num_microbatches=2)
