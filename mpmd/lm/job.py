"""``mpmd train CONFIG``: the language-model pretraining run.

Everything is checked and prepared before an actor starts (the config, the schedule against
the stages, the corpus tokenized into prepared token files, Note [prepared data] in
``prepare.py``); then the pipeline is built from stage factories (the controller holds no
weights), the actors that need each step's batch read it themselves from the prepared files
(Note [actors read their rows] in ``tokens.py``: the controller sends the step number and
holds no tokens), and it trains step by step with one step in flight: an
asynchronous checkpoint every ``run.checkpoint_every`` steps (the newest
``run.keep_checkpoints`` kept), validation loss and perplexity every ``run.eval_every``,
a record per step (loss, grad norm, LR, tokens/s, MFU; a mixture of experts' expert loads,
auxiliary loss and router bias: Note [expert load metrics] in ``moe_metrics.py``) to the
progress display, CSV and TensorBoard; at the end a checkpoint and the Hugging Face export.  A run directory that
holds checkpoints is resumed from the newest: the step count, the parameters, optimizer
and scheduler states and RNG come back, and the batches are taken from that step on
(Note [data order] in ``tokens.py``), so an interrupted and resumed run equals the
uninterrupted one."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time
from typing import Any, Callable, Optional

from ..errors import StageFailedError
from ..pipeline import Pipeline
from ..planning.hf import causal_lm_loss, next_token_loss
from ..runtime import FED
from ..runtime.devices import local_gpus
from ..training.callbacks import CSVLogger, TensorBoardLogger
from ..training.checkpoint import is_checkpoint, read_manifest
from ..training.fit import HISTORY_KEPT
from ..training.fit_checkpoints import FitCheckpoints
from ..training.progress import Progress
from .checks import check_pipeline
from .config import MOE_FAMILIES, SCHEDULE_AUTO, TrainConfig
from .config_io import to_toml
from .data import eos_id
from .flops import document_keys_per_token, flops_per_token, mfu, peak_flops
from .models import LlamaSpec, export_hf, llama_spec, stage_factories
from .moe_metrics import expert_load_record, moe_record
from .plan import resumed_layers, stage_layer_counts
from .corpus import plan_units
from .prepare import prepare_data, prepare_tokenizer
from .recipe import pipeline_options
from .tokens import TokenData

__all__ = ["TrainResult", "run_training", "check_pipeline", "RECORD_FIELDS"]

RECORD_FIELDS = ("step", "loss", "grad_norm", "lr", "skipped", "step_time_s", "tokens_per_s", "mfu", "val_loss",
                 "val_ppl")


@dataclasses.dataclass
class TrainResult:
    run_dir: str
    losses: list  # per step from step 1 (a resumed run: the checkpoint's first)
    val: list  # (step, loss, perplexity)
    checkpoint: Optional[str]
    export_dir: Optional[str]
    spec: LlamaSpec
    state_dict: Optional[dict] = None  # with keep_state
    sample: Optional[tuple] = None  # (input_ids, the pipeline's logits) of a validation batch, with the export


def ensure_ray(actors: int) -> None:
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=max(os.cpu_count() or 1, actors), num_gpus=local_gpus(), include_dashboard=False,
                 log_to_driver=False, logging_level=logging.WARNING, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})


def run_training(cfg: TrainConfig, *, log: Callable[[str], None] = print, keep_state: bool = False) -> TrainResult:
    check_pipeline(cfg)
    run_dir = cfg.run.dir
    os.makedirs(run_dir, exist_ok=True)
    ensure_ray(cfg.parallel.stages * cfg.parallel.dp * cfg.parallel.tp * cfg.parallel.cp)
    data, tok = prepare(cfg, log)
    spec = llama_spec(cfg.model, tok.get_vocab_size())
    seq_len = cfg.data.seq_len
    counts = None
    if spec.family != "gpt":  # Note [balanced layers]; a resumed run keeps its checkpoint's
        counts = resumed_layers(cfg, stage_layer_counts(cfg, spec, log), log)
    with open(os.path.join(run_dir, "config.toml"), "w") as f:
        f.write(to_toml(cfg))
    log(f"data: {data.train_sequences} training and {data.val_sequences} validation sequences of {seq_len} tokens "
        f"({data.per_epoch} steps per epoch)")
    factories = stage_factories(spec, cfg.parallel.stages, seq_len, compile=cfg.parallel.compile,
                                backend=cfg.parallel.compile_backend, counts=counts)
    fpt = flops_per_token(spec, seq_len, causal=True)  # Note [MFU]
    options = pipeline_options(cfg.parallel, cfg.optim, cfg.data.document_mask)
    sample = data.batch(0) if cfg.parallel.schedule == SCHEDULE_AUTO else None
    loss_fn = next_token_loss if data.shift_targets else causal_lm_loss  # Note [shifted targets] in tokens.py
    with Pipeline(factories, loss_fn=loss_fn, sample=sample, **options) as pipe:
        devices = len(pipe.actors)
        peak, peak_from = peak_flops(pipe.device or "cpu", cfg.parallel.precision, cfg.run.peak_flops)
        experts = (f", {spec.moe.num_experts} experts top-{spec.moe.top_k} over ep "
                   f"{pipe.config.layout.ep}" if spec.moe is not None else "")
        log(f"model: {spec.family}, {spec.num_layers} layers, hidden {spec.hidden_size}, vocab {spec.vocab_size}"
            f"{experts}; {len(factories)} stages{f' of {counts} decoder layers' if counts else ''} on {devices} actors, "
            f"schedule {pipe.schedule.name}, "
            f"{pipe.schedule.num_microbatches} microbatches, dp {pipe.config.layout.dp}, tp {pipe.config.layout.tp}"
            + (f", cp {pipe.config.layout.cp}" if pipe.config.layout.cp > 1 else "")
            + (", attention within documents" if pipe.config.layout.document_mask else ""))
        keys = "each step's documents'" if cfg.data.document_mask else f"{(seq_len + 1) / 2:g}"
        log(f"MFU: {fpt:.4g} FLOPs/token (causal attention, {keys} keys per token) over {devices} x {peak:.4g} "
            f"FLOP/s ({peak_from})" if peak else f"MFU: not reported: {peak_from}")
        if not cfg.data.document_mask:  # the controller sends the rows and positions: Note [shifted targets]
            data.attach(pipe.engine)

        def mfu_of(tps: float, keys: Optional[float] = None) -> Optional[float]:  # keys: a step's documents'
            flops = fpt if keys is None else flops_per_token(spec, seq_len, keys_per_token=keys)
            return mfu(tps, flops, devices, peak) if peak else None

        loop = _Loop(cfg, pipe, data, log, mfu_of)
        loop.run()
        result = TrainResult(run_dir, loop.losses, loop.val, loop.ckpt.last, None, spec)
        if keep_state:
            result.state_dict = pipe.state_dict()
        if cfg.run.export and spec.family != "gpt":
            ids = data.val_batches()[0][0]
            result.sample = (ids, pipe.predict(ids, **data.side(ids)))
            result.export_dir = export_hf(spec, pipe, tok, os.path.join(run_dir, "hf"), eos_id(tok))
            log(f"exported: {result.export_dir} (transformers.AutoModelForCausalLM.from_pretrained loads it)")
        elif cfg.run.export:
            log(f"no Hugging Face export for model.family = {spec.family!r} (the demo GPT); the checkpoints "
                f"hold the weights")
    return result


def prepare(cfg: TrainConfig, log: Callable[[str], None] = print) -> tuple[TokenData, Any]:
    """The run's tokenizer and its prepared data (``mpmd prepare-data``; ``mpmd train`` before
    its actors start): found, or made now (Note [prepared data] in ``prepare.py``)."""
    units = plan_units(cfg.data)  # the files' checks come first
    tok = prepare_tokenizer(units, cfg.data, cfg.tokenizer, cfg.run.dir, log)
    tokens = prepare_data(cfg.data, cfg.run.dir, tok.to_str(), log=log, units=units)
    data = TokenData(tokens, seq_len=cfg.data.seq_len, batch_size=cfg.optim.batch_size,
                     val_fraction=cfg.data.val_fraction, eval_batches=cfg.run.eval_batches, seed=cfg.data.shuffle_seed,
                     shift_targets=cfg.parallel.cp > 1,  # Note [shifted targets] in tokens.py
                     eos=eos_id(tok) if cfg.data.document_mask else None)
    return data, tok


class _Loop:
    """The steps of one run (module docstring)."""

    def __init__(self, cfg: TrainConfig, pipe: Pipeline, data: TokenData, log: Callable, mfu_of: Callable) -> None:
        self.cfg, self.pipe, self.data, self.log, self.mfu_of = cfg, pipe, data, log, mfu_of
        r = cfg.run
        directory = os.path.join(r.dir, "checkpoints") if r.checkpoint_every else None
        self.ckpt = FitCheckpoints(pipe.engine, directory=directory, every=r.checkpoint_every or None,
                                   keep=r.keep_checkpoints, asynchronous=True, state=self._state)
        self.losses: list[float] = []
        self.keys: dict[int, float] = {}  # step -> its documents' keys per token (data.document_mask; Note [MFU])
        self.val: list[tuple[int, float, float]] = []
        self.loggers: list[Any] = []
        self.load_csv = CSVLogger(os.path.join(r.dir, "expert_load.csv")) if r.csv and cfg.model.family in MOE_FAMILIES \
            else None  # Note [expert load metrics]
        self.clock = time.perf_counter()  # when the last logged interval began (run() starts it again)
        if r.csv:
            self.loggers.append(CSVLogger(os.path.join(r.dir, "metrics.csv")))
        if r.tensorboard:
            self.loggers.append(TensorBoardLogger(os.path.join(r.dir, "tensorboard")))

    def _state(self) -> dict:
        # the last steps only, as fit's (Note [fit's kept history]): metrics.csv has them all
        return {"history": self.losses[-HISTORY_KEPT:], "val": [list(v) for v in self.val[-HISTORY_KEPT:]]}

    def _resume(self) -> bool:
        """Continue from the newest checkpoint, if any (True)."""
        if self.ckpt.directory is None or not self.cfg.run.resume:
            return False
        manifest = self.ckpt.resume()
        # keep_checkpoints counts the run's checkpoints, also those written before this resume.
        root = self.ckpt.directory
        self.ckpt.written = sorted(os.path.join(root, n) for n in os.listdir(root) if n.startswith("step-")
                                   and is_checkpoint(os.path.join(root, n))) if os.path.isdir(root) else []
        if manifest is not None:
            state = manifest.get("fit") or {}
            self.losses = [float(x) for x in state.get("history", [])]
            self.val = [tuple(v) for v in state.get("val", [])]
            self.log(f"resumed from {self.ckpt.last} at step {self.pipe.engine.step_count}")
        return manifest is not None

    def run(self) -> None:
        if not self._resume() and self.cfg.model.init_from:
            self.pipe.load_safetensors(self.cfg.model.init_from)
            self.log(f"weights from {self.cfg.model.init_from}")
        start = self.pipe.engine.step_count
        end = self.cfg.run.stop_after or self.cfg.optim.steps
        bar = Progress(self.cfg.optim.steps, enabled=self.cfg.run.progress, log_every=self.cfg.run.log_every,
                       start=start)
        pending = None
        self.clock = time.perf_counter()
        try:
            for step in range(start, end):
                issued = self._issue(step)
                if pending is not None:
                    self._complete(pending, bar)
                pending = issued
                if self._due(step + 1) or self.ckpt.due(step):
                    self._complete(pending, bar)
                    pending = None
            if pending is not None:
                self._complete(pending, bar)
            if end > start and (not self.val or self.val[-1][0] != end):
                self._evaluate(end)
            self.ckpt.at_end()
        except BaseException as e:
            self.ckpt.after_failure(e)
            raise
        finally:
            bar.close()
            for logger in self.loggers + ([self.load_csv] if self.load_csv else []):
                logger.on_end()

    def _issue(self, step: int) -> Any:
        if not self.cfg.data.document_mask:
            return self.pipe.step_async(FED, None)  # the actors read the step's rows
        ids, targets = self.data.batch(step)  # with the documents' positions: Note [shifted targets] in tokens.py
        side = self.data.side(ids)
        self.keys[step] = document_keys_per_token(side["position_ids"])
        return self.pipe.step_async(ids, targets, **side)

    def _due(self, step: int) -> bool:
        return step % self.cfg.run.eval_every == 0

    def _complete(self, pending: Any, bar: Progress) -> None:
        try:
            result = pending.wait()
        except StageFailedError as e:
            if self.cfg.parallel.compile and not self.losses:
                raise RuntimeError(f"parallel.compile: a stage failed in its first step, compiled with "
                                   f"torch.compile(backend={self.cfg.parallel.compile_backend!r}): {e}\nSet "
                                   f"parallel.compile = false to train eagerly") from e
            raise
        now = time.perf_counter()
        seconds = now - self.clock
        step = result.step + 1
        tokens = self.cfg.optim.batch_size * self.cfg.data.seq_len / seconds if seconds > 0 else None
        record = dict.fromkeys(RECORD_FIELDS)
        record.update(step=step, loss=result.loss, grad_norm=result.grad_norm, lr=result.lr, skipped=result.skipped,
                      step_time_s=seconds, tokens_per_s=tokens,
                      mfu=self.mfu_of(tokens, self.keys.pop(result.step, None)) if tokens else None)
        record.update(moe_record(result.moe_metrics))
        loads = expert_load_record(step, result.moe_metrics) if self.load_csv else None
        self.losses.append(result.loss)
        self.ckpt.settle(wait=False)
        if self._due(step):
            record["val_loss"], record["val_ppl"] = self._evaluate(step)
        if self.ckpt.due(result.step):
            self.ckpt.save()
        bar.update(record)
        logged = step % self.cfg.run.log_every == 0 or record["val_loss"] is not None
        for logger, row in [(x, record) for x in self.loggers] + ([(self.load_csv, loads)] if loads else []):
            logger.on_step(row)
            if logged:
                logger.on_log(row)
        self.clock = time.perf_counter()

    def _evaluate(self, step: int) -> tuple[float, float]:
        batches = self.data.val_batches()
        loss = sum(self.pipe.evaluate(x, y, **self.data.side(x)) for x, y in batches) / len(batches)
        ppl = math.exp(min(loss, 50.0))
        self.val.append((step, loss, ppl))
        self.log(f"step {step}: validation loss {loss:.4f}, perplexity {ppl:.2f}")
        return loss, ppl


def checkpoint_step(path: str) -> int:
    return int(read_manifest(path)["step"])
