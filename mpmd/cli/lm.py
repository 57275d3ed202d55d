"""``mpmd train CONFIG [--set section.key=value ...] [--print-config] [--dry-run]``: language-model
pretraining from a TOML config (``mpmd/lm``); ``mpmd prepare-data CONFIG [--set ...]``: its
corpus tokenized into the prepared token files the run reads (``mpmd/lm/prepare.py``)."""

from __future__ import annotations

import sys


def _config_arguments(p) -> None:
    p.add_argument("config", nargs="?", default=None, help="the TOML config (default: the built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a config value (TOML syntax), e.g. --set optim.lr=1e-3; repeatable")


def _config(args):
    """The config of ``args``, or None when it is refused (the reason printed)."""
    from ..lm import ConfigError, load_config

    try:
        return load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def add_parser(sub) -> None:
    p = sub.add_parser("train", help="pretrain a language model from a TOML config (configs/debug.toml)")
    _config_arguments(p)
    p.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    p.add_argument("--config-reference", action="store_true",
                   help="print every config key with its type, default and meaning (docs/config.md) and exit")
    p.add_argument("--dry-run", action="store_true",
                   help="print the plan (stages, schedule, bubble, memory per actor) without starting actors")
    p.set_defaults(run=_train)

    p = sub.add_parser("prepare-data", help="tokenize a config's corpus into the token files mpmd train reads")
    _config_arguments(p)
    p.set_defaults(run=_prepare)


def _prepare(args) -> int:
    import os

    from ..lm.job import ensure_ray, prepare

    cfg = _config(args)
    if cfg is None:
        return 2
    ensure_ray(1)
    os.makedirs(cfg.run.dir, exist_ok=True)
    try:
        data, _ = prepare(cfg)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{data.tokens.directory}: {data.train_sequences} training and {data.val_sequences} validation sequences "
          f"of {cfg.data.seq_len} tokens ({data.per_epoch} steps of {cfg.optim.batch_size} per epoch)")
    return 0


def _train(args) -> int:
    from ..lm import to_toml

    if args.config_reference:
        from ..lm.config_doc import reference

        print(reference(), end="")
        return 0
    cfg = _config(args)
    if cfg is None:
        return 2
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    if args.dry_run:
        from ..lm.dry_run import dry_run

        try:
            plan = dry_run(cfg)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(plan.text())
        return 0 if plan.fits is not False else 1
    from ..lm import check_pipeline, run_training

    try:
        check_pipeline(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from ..errors import PipelineTimeoutError

    try:
        result = run_training(cfg)
    except PipelineTimeoutError as e:  # Note [train's step timeout] in mpmd/lm/config.py
        print(f"error: {e}\n(parallel.step_timeout_s = {cfg.parallel.step_timeout_s:g}: a step that legitimately takes "
              f"longer needs --set parallel.step_timeout_s=SECONDS, or 0 for no limit; run again to resume from "
              f"the last checkpoint, if any)", file=sys.stderr)
        return 1
    if len(result.val) >= 2:
        first, last = result.val[0], result.val[-1]
        print(f"validation perplexity {first[2]:.2f} (step {first[0]}) -> {last[2]:.2f} (step {last[0]})")
    return 0
