"""``python -m mpmd export CHECKPOINT --hf OUT``: a checkpoint's weights as Hugging Face
safetensors, offline (no Ray, no actors), one tensor at a time (``export_checkpoint`` in
mpmd/training/export.py).  A checkpoint of an ``mpmd train`` run (``RUN/checkpoints/step-N``)
also gets the run's model config and tokenizer, so ``from_pretrained(OUT)`` loads it."""

from __future__ import annotations

import os
import sys

__all__ = ["add_parser"]


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="a checkpoint's weights as Hugging Face safetensors (offline)")
    p.add_argument("checkpoint", help="a checkpoint directory (Pipeline.save's, or a run's step-N)")
    p.add_argument("--hf", required=True, metavar="OUT", help="the directory to write")
    p.add_argument("--dtype", default=None, help="cast to this torch dtype, e.g. bfloat16 (default: as trained)")
    p.add_argument("--max-shard-gb", type=float, default=2.0, help="flush a safetensors file at this size")
    p.set_defaults(run=_export)


def _export(args) -> int:
    from ..training.checkpoint import is_checkpoint, latest_checkpoint
    from ..training.export import export_checkpoint

    path = args.checkpoint if is_checkpoint(args.checkpoint) else latest_checkpoint(args.checkpoint)
    if path is None:
        print(f"error: {args.checkpoint} holds no complete checkpoint (no manifest.json)", file=sys.stderr)
        return 2
    try:  # everything read and checked before anything is written
        metadata = _run_metadata(path)
        weights = export_checkpoint(path, args.hf, dtype=args.dtype, max_shard_bytes=int(args.max_shard_gb * 2**30))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {len(weights)} tensors of {path} to {args.hf}")
    if metadata is not None:
        from ..lm.models import write_hf_metadata

        run_dir, spec, tok, eos = metadata
        write_hf_metadata(spec, tok, args.hf, eos)
        print(f"with the run's config and tokenizer ({run_dir}): transformers' from_pretrained loads it")
    return 0


def _run_metadata(path: str):
    """For a checkpoint of an ``mpmd train`` run (``RUN/checkpoints/step-N`` beside ``RUN/config.toml``
    and ``RUN/tokenizer/tokenizer.json``) of a Llama: (the run's directory, the model's spec, the
    tokenizer, its EOS id); else None.  Only the config's ``[model]`` is read (``load_model_config``):
    an export needs neither the training data nor the other files the run's machine had, so it
    runs on any machine that has the checkpoint."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    config, tokenizer = os.path.join(run_dir, "config.toml"), os.path.join(run_dir, "tokenizer", "tokenizer.json")
    if not (os.path.isfile(config) and os.path.isfile(tokenizer)):
        return None
    from ..lm.config_io import load_model_config
    from ..lm.data import eos_id, load_tokenizer
    from ..lm.models import llama_spec

    model, tok = load_model_config(config), load_tokenizer(tokenizer)
    if model.family != "llama":
        return None
    return run_dir, llama_spec(model, tok.get_vocab_size()), tok, eos_id(tok)
