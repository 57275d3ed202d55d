"""mpmd train end to end on a tiny config (2 actors, a few steps): equal to single-process
training, validation perplexity falls, an interrupted and resumed run equals the
uninterrupted one (losses and parameters), the export loads in transformers with the
pipeline's logits."""

from __future__ import annotations

import csv
import os

import pytest
import torch

import mpmd
from mpmd.lm import load_config, run_training
from mpmd.lm.job import prepare
from mpmd.lm.models import stage_factories
from mpmd.lm.config_io import ConfigError
from mpmd.lm.plan import resumed_layers, saved_layer_counts, stage_layer_counts
from mpmd.lm.recipe import AdamWFactory, LRSchedule
from mpmd.planning import causal_lm_loss

from tests.models import reference_train

TINY = ["optim.steps=8", "optim.batch_size=8", "optim.warmup_steps=2", "optim.lr=1e-2", "parallel.microbatches=2",
        "data.seq_len=32", "tokenizer.vocab_size=300", "run.eval_every=4", "run.checkpoint_every=4",
        "run.log_every=2", "run.progress=false", "run.eval_batches=1"]


def _config(run_dir, *extra):
    # The runs share their prepared data (the same corpus and tokenizer: Note [prepared data]).
    prepared = os.path.join(os.path.dirname(run_dir), "prepared")
    return load_config("configs/debug.toml", TINY + [f"run.dir={str(run_dir)!r}", f"data.prepared_dir={prepared!r}",
                                                     *extra])


@pytest.fixture(scope="module")
def runs(ray_session, tmp_path_factory):
    root = tmp_path_factory.mktemp("lm")
    full = run_training(_config(root / "full"), keep_state=True, log=lambda *a: None)
    part = run_training(_config(root / "cut", "run.stop_after=4", "run.export=false", "run.keep_checkpoints=1"),
                        log=lambda *a: None)
    resumed = run_training(_config(root / "cut", "run.keep_checkpoints=1"), keep_state=True, log=lambda *a: None)
    return root, full, part, resumed


def sum_of_scaled_losses(losses, parts: int) -> float:
    """A step's loss as the run's history holds it: the sum of each microbatch's loss / parts."""
    return sum((loss / parts).item() for loss in losses)


def _reference(cfg, steps=None):
    """The same training in one process: nn.Sequential of the stages built as the actors build
    them, AdamW per parameter, gradient accumulation over the microbatches, clipping, the LR;
    the batches read here from the run's prepared data, as the actors read them by step."""
    data, tok = prepare(cfg, log=lambda *a: None)  # the run's tokenizer and prepared files, found
    from mpmd.lm.models import llama_spec

    spec = llama_spec(cfg.model, tok.get_vocab_size())
    counts = stage_layer_counts(cfg, spec)
    stages = mpmd.build_stages(stage_factories(spec, 2, cfg.data.seq_len, counts=counts), seed=cfg.optim.seed)
    def lr_scheduler(opt):
        return torch.optim.lr_scheduler.LambdaLR(opt, LRSchedule.of(cfg.optim))

    batches = [data.batch(step) for step in range(steps or cfg.optim.steps)]
    # The norm in float64, as the actors take it (Note [agreed update]): in float32 its last
    # bit moves the clip coefficient, and AdamW turns that into a visible step on an element
    # whose gradient is near zero (7e-5 relative on one of 2048 k_proj weights).
    model, losses = reference_train(stages, batches, cfg.parallel.microbatches * cfg.parallel.dp, causal_lm_loss,
                                    AdamWFactory(cfg.optim), clip=cfg.optim.clip_grad_norm, norm_in_float64=True,
                                    lr_scheduler=lr_scheduler, step_loss=sum_of_scaled_losses)
    return losses, {k: v for stage in model for k, v in stage.state_dict().items()}  # the model's own keys


def test_equals_single_process_training(runs):
    root, full, _, _ = runs
    losses, state = _reference(_config(root / "full"))
    torch.testing.assert_close(torch.tensor(full.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for k, v in state.items():
        torch.testing.assert_close(full.state_dict[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_validation_perplexity_falls_and_metrics_are_written(runs):
    _, full, _, _ = runs
    assert [v[0] for v in full.val] == [4, 8]
    assert full.val[-1][2] < full.val[0][2]
    with open(os.path.join(full.run_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    assert [int(r["step"]) for r in rows] == [2, 4, 6, 8]
    assert rows[1]["val_ppl"] and float(rows[1]["mfu"]) > 0 and float(rows[1]["tokens_per_s"]) > 0
    assert os.listdir(os.path.join(full.run_dir, "tensorboard"))
    assert sorted(os.listdir(os.path.join(full.run_dir, "checkpoints"))) == ["step-00000004", "step-00000008"]


def test_interrupted_and_resumed_equals_uninterrupted(runs):
    _, full, part, resumed = runs
    assert len(part.losses) == 4 and part.checkpoint.endswith("step-00000004")
    assert resumed.losses == full.losses  # the resumed run's history: the checkpoint's 4, then its own
    assert os.listdir(os.path.join(resumed.run_dir, "checkpoints")) == ["step-00000008"]  # keep 1, across the resume
    for k, v in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=1e-5, atol=0, msg=k)


def test_uneven_layers_train_as_one_process(runs):
    """``parallel.layers = [1, 3]`` (Note [balanced layers]): the stages the run builds hold 1
    and 3 decoder layers, and its losses and parameters equal one process's."""
    root = runs[0]
    extra = ["parallel.layers=[1, 3]", "optim.steps=4", "optim.warmup_steps=1", "run.checkpoint_every=0",
             "run.export=false", f"tokenizer.path={os.path.join(root, 'full', 'tokenizer', 'tokenizer.json')!r}"]
    cfg = _config(root / "uneven", *extra)
    said = []
    run = run_training(cfg, keep_state=True, log=said.append)
    assert {k.split(".")[2] for k in run.state_dict if k.startswith("model.layers.")} == {"0", "1", "2", "3"}
    losses, state = _reference(cfg)
    assert any("2 stages of [1, 3] decoder layers" in line for line in said), said
    torch.testing.assert_close(torch.tensor(run.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)
    for k, v in state.items():
        torch.testing.assert_close(run.state_dict[k], v, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")


def test_a_resumed_run_keeps_the_layers_of_its_checkpoint(runs):
    """Note [balanced layers]: the full run's checkpoints hold 2 and 2 layers; "balanced"
    resumes them whatever the search says now, an explicit split that differs is refused
    before any actor starts, saying what to set."""
    root = runs[0]
    assert saved_layer_counts(os.path.join(root, "full", "checkpoints", "step-00000008")) == [2, 2]
    said = []
    balanced = _config(root / "full", "parallel.layers=balanced")
    assert resumed_layers(balanced, [3, 1], said.append) == [2, 2] and "written with [2, 2]" in said[0]
    assert resumed_layers(_config(root / "full"), [2, 2], said.append) == [2, 2] and len(said) == 1
    fresh = _config(root / "full", "parallel.layers=[1, 3]", "run.resume=false")
    assert resumed_layers(fresh, [1, 3]) == [1, 3]
    with open(os.path.join(root, "full", "config.toml")) as f:
        written = f.read()
    with pytest.raises(ConfigError, match=r"was written with \[2, 2\] decoder layers per stage, but parallel.layers "
                                          r"gives \[1, 3\]: set parallel.layers = \[2, 2\] to resume it"):
        run_training(_config(root / "full", "parallel.layers=[1, 3]"), log=lambda *a: None)
    with open(os.path.join(root, "full", "config.toml")) as f:
        assert f.read() == written  # refused before the run's config was rewritten


@pytest.mark.parametrize("parallel", ["parallel.dp=2", "parallel.tp=2"])
def test_replicas_and_tp_ranks_read_their_rows_and_resume_exactly(runs, parallel):
    """At dp=2 each replica's first- and last-stage actors read the replica's rows, at tp=2
    every TP rank of those stages reads them (Note [actors read their rows]): the losses equal
    one process's, and a run interrupted after 2 steps and resumed equals the uninterrupted one."""
    root = runs[0]
    name = parallel.replace("=", "")
    extra = [parallel, "optim.steps=4", "optim.warmup_steps=1", "run.eval_every=4", "run.checkpoint_every=2",
             "run.export=false", "run.keep_checkpoints=1",
             f"tokenizer.path={os.path.join(root, 'full', 'tokenizer', 'tokenizer.json')!r}"]
    full = run_training(_config(root / f"{name}-full", *extra), keep_state=True, log=lambda *a: None)
    run_training(_config(root / f"{name}-cut", *extra, "run.stop_after=2"), log=lambda *a: None)
    resumed = run_training(_config(root / f"{name}-cut", *extra), keep_state=True, log=lambda *a: None)
    assert resumed.losses == full.losses and len(full.losses) == 4
    for k, v in full.state_dict.items():
        torch.testing.assert_close(resumed.state_dict[k], v, rtol=1e-5, atol=0, msg=k)
    losses, _ = _reference(_config(root / f"{name}-full", *extra))
    torch.testing.assert_close(torch.tensor(full.losses), torch.tensor(losses), rtol=1e-5, atol=1e-6)


def test_the_profile_shows_what_reading_the_rows_costs(runs):
    """A fed step's read is its own slice on the actors that read (``DATA``): the first and the
    last stage's actors here, each reading the step's rows from the prepared files."""
    from mpmd.lm.models import llama_spec
    from mpmd.runtime import FED

    root, full, _, _ = runs
    cfg = _config(root / "full")
    data, tok = prepare(cfg, log=lambda *a: None)
    spec = llama_spec(cfg.model, tok.get_vocab_size())
    with mpmd.Pipeline(stage_factories(spec, 2, cfg.data.seq_len), loss_fn=causal_lm_loss, num_microbatches=2,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.0), device="cpu") as pipe:
        data.attach(pipe.engine)
        report = pipe.profile(FED, None, steps=1)
        assert pipe.engine.last_dispatch.bare == 2  # the controller sent no actor any data
    assert [s.kind for s in report.slices].count("DATA") == 2 and all(t > 0 for t in report.data_seconds)
    assert "data ms" in report.summary()


def test_compiled_layers_train_as_eager(runs):
    """parallel.compile: each decoder layer compiled on the actors (aot_eager here: the inductor
    backend's C++ build takes minutes on this machine; configs use inductor) trains within float
    tolerance of eager."""
    root, full, _, _ = runs
    compiled = run_training(_config(root / "compiled", "run.stop_after=4", "run.export=false",
                                    "run.checkpoint_every=100", "parallel.compile=true",
                                    "parallel.compile_backend=aot_eager"), log=lambda *a: None)
    torch.testing.assert_close(torch.tensor(compiled.losses), torch.tensor(full.losses[:4]), rtol=1e-5, atol=1e-6)


def test_export_loads_in_transformers_with_the_pipelines_logits(runs):
    import transformers

    _, full, _, _ = runs
    model = transformers.AutoModelForCausalLM.from_pretrained(full.export_dir)
    ids, logits = full.sample
    with torch.no_grad():
        theirs = model(ids).logits
    torch.testing.assert_close(theirs, logits, rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(full.export_dir)
    assert tok.eos_token == "<|endoftext|>"
    assert tok.decode(tok("pipeline stages")["input_ids"]) == "pipeline stages"


def test_a_run_starts_from_an_exported_model(runs):
    """``model.init_from``: a run starts from a safetensors directory (here the first run's
    export, which the actors wrote), each actor reading its own part; its first loss is the
    exported model's loss on the first batch, computed by transformers in this process."""
    import transformers

    root, full, _, _ = runs
    tokenizer = os.path.join(root, "full", "tokenizer", "tokenizer.json")
    cfg = _config(root / "init", "run.stop_after=1", "run.export=false", f"model.init_from={full.export_dir!r}",
                  f"tokenizer.path={tokenizer!r}")
    started = run_training(cfg, log=lambda *a: None)
    ids, labels = prepare(cfg, log=lambda *a: None)[0].batch(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(full.export_dir, dtype=torch.float32)
    with torch.no_grad():
        want = causal_lm_loss(model(ids).logits, labels).item()
    assert started.losses[0] == pytest.approx(want, rel=1e-5)
    assert started.losses[0] < full.losses[0]  # trained weights, not a fresh initialisation
    with pytest.raises(ValueError, match="model.init_from = '/nowhere' is not a directory"):
        _config(root / "bad", "model.init_from='/nowhere'")


def test_mpmd_export_writes_a_checkpoint_as_a_model_transformers_loads(runs, tmp_path, capsys):
    """``mpmd export RUN/checkpoints --hf OUT``: the newest checkpoint's weights, offline, with
    the run's config and tokenizer; the model gives the pipeline's logits (the last checkpoint
    is the end of training)."""
    import transformers

    from mpmd.cli import main

    root, full, _, _ = runs
    assert main(["export", str(root / "full" / "checkpoints"), "--hf", str(tmp_path / "hf")]) == 0
    assert "transformers' from_pretrained loads it" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
    ids, logits = full.sample
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, logits, rtol=1e-5, atol=1e-5)
    assert main(["export", str(tmp_path), "--hf", str(tmp_path / "none")]) == 2


def test_context_parallel_trains_as_cp_1(runs):
    """``parallel.cp = 2``: each sequence sharded over 2 actors of each stage, the targets shifted
    in the data and the loss without the shift (Note [shifted targets] in mpmd/lm/tokens.py); its
    first steps' losses equal the cp=1 run's (the same LR schedule: only ``run.stop_after``
    differs; the second loss is after an optimizer step on the CP-reduced gradients)."""
    root, full, _, _ = runs
    tokenizer = os.path.join(root, "full", "tokenizer", "tokenizer.json")
    said = []
    cp = run_training(_config(root / "cp2", "parallel.cp=2", "run.stop_after=2", "run.export=false",
                              "run.checkpoint_every=0", f"tokenizer.path={tokenizer!r}"), log=said.append)
    assert any("on 4 actors" in line and "cp 2" in line for line in said), said
    torch.testing.assert_close(torch.tensor(cp.losses), torch.tensor(full.losses[:2]), rtol=1e-5, atol=0)
    assert full.losses[0] != full.losses[1] and cp.val[-1][0] == 2
