"""Language-model pretraining from a config file: ``mpmd train CONFIG`` (``mpmd/cli/lm.py``).

    config.py     the typed, frozen config sections and their checks (TrainConfig)
    model_config.py  the [model] section and the named sizes, the mixture-of-experts families' too
    limits.py     the ranges of the config's numbers, checked by every section
    config_io.py  TOML and --set overrides into a TrainConfig; unknown keys refused with the near ones
    models.py     the Llama / MoE / demo GPT as stage factories (weights built on the actors); the HF export
    moe_models.py the Qwen3-MoE and DeepSeek-V3 families: their shape and Hugging Face config
    moe_metrics.py  a mixture of experts' loads, auxiliary loss and router bias in the step record
    data.py       the tokenizer (a byte-level BPE, or the user's) and the training files' formats
    corpus.py     the training files as units of work and their documents
    prepare.py    the corpus tokenized once by Ray Data tasks into token files (mpmd prepare-data)
    tokens.py     the prepared tokens read by step: the order, the held-out split, the actors' feeds
    recipe.py     AdamW, warm-up + cosine/linear decay, the Pipeline's options
    flops.py      FLOPs per token and MFU (Note [MFU])
    checks.py     what a run refuses before anything starts (the run and its dry run)
    job.py        the run: checkpoints, resume, validation, metrics, export
    dry_run.py    the plan without actors (--dry-run)
"""

from .config import (MODEL_SIZES, DataConfig, ModelConfig, OptimConfig, ParallelConfig, RunConfig, TokenizerConfig,
                     TrainConfig)
from .config_io import ConfigError, load_config, to_toml
from .flops import flops_per_token, mfu
from .checks import check_pipeline
from .job import TrainResult, run_training

__all__ = ["TrainConfig", "ModelConfig", "TokenizerConfig", "DataConfig", "OptimConfig", "ParallelConfig",
           "RunConfig", "MODEL_SIZES", "ConfigError", "load_config", "to_toml", "flops_per_token", "mfu",
           "TrainResult", "check_pipeline", "run_training"]
