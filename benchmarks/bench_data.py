"""``python -m mpmd bench data``: the controller's memory in ``mpmd train`` against the size
of the corpus, and what ``mpmd prepare-data`` costs (Note [prepared data] in mpmd/lm/prepare.py).

Corpora of ``--sizes`` MB of generated text (paragraphs of words drawn from a Zipf-like
vocabulary of made-up words; a block of text repeated up to the size) are written once under
``--dir``.  For each, ``mpmd train`` (the debug config, ``--steps`` steps, no checkpoints or
export) runs as a process of its own, preparing its data first.  Printed per corpus: the
controller's peak RSS (the kernel's ``VmHWM`` of that process when training ends) and its
ratio to the smallest corpus's, the tokens, the seconds and tokens/s of the preparation,
and the tokenizing tasks' peak RSS and how far it rose above where it began.  Then the
second corpus is prepared again with 1 and with 2 workers: tokens/s each and the ratio.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

from .harness import print_table, progress

__all__ = ["HELP", "add_arguments", "run", "write_corpus"]

HELP = "mpmd train's controller peak RSS against corpus size; prepare-data's tokens/s and memory"


def add_arguments(p) -> None:
    p.add_argument("--sizes", default="10,100,1000", help="corpus sizes in MB, comma-separated (default: 10,100,1000)")
    p.add_argument("--steps", type=int, default=20, help="training steps of each run (default: 20)")
    p.add_argument("--dir", default=None, help="where the corpora and runs go (default: a temporary folder)")
    p.set_defaults(run=run)


def write_corpus(path: str, megabytes: float, seed: int = 0) -> None:
    """``megabytes`` of text: paragraphs of made-up words, Zipf-like frequencies (a block repeated)."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(5000)]
    freq = 1.0 / np.arange(1, len(words) + 1)
    picks = rng.choice(len(words), size=1_500_000, p=freq / freq.sum())
    paragraphs, at = [], 0
    while at < len(picks):
        n = int(rng.integers(20, 200))
        chunk = [words[i] for i in picks[at:at + n]]
        paragraphs.append("\n".join(" ".join(chunk[j:j + 12]) for j in range(0, len(chunk), 12)))
        at += n
    block = ("\n\n".join(paragraphs) + "\n\n").encode()
    target = int(megabytes * 2 ** 20)
    with open(path, "wb") as f:
        written = 0
        while written < target:
            piece = block[:target - written]
            f.write(piece)
            written += len(piece)


_CHILD = """
import json, sys
from mpmd.cli import main
code = main(sys.argv[1:])
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print("BENCH " + json.dumps({"code": code, "peak_rss": peak}), flush=True)
"""


def _train(corpus: str, run_dir: str, steps: int, extra=()) -> dict:
    """``mpmd train`` in a process of its own: its exit code and peak RSS, and the preparation's index."""
    sets = [f"data.train_files=[{corpus!r}]", f"run.dir={run_dir!r}", f"optim.steps={steps}", "optim.warmup_steps=2",
            "run.checkpoint_every=0", "run.export=false", "run.progress=false", "run.tensorboard=false",
            f"run.eval_every={steps}", "run.eval_batches=1", *extra]
    argv = ["train", "configs/debug.toml"] + [x for s in sets for x in ("--set", s)]
    out = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("BENCH ")), None)
    if out.returncode or line is None or json.loads(line[6:])["code"]:
        raise RuntimeError(f"mpmd train failed on {corpus}:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = json.loads(line[6:])
    prepared = os.path.join(run_dir, "prepared")
    (key,) = os.listdir(prepared)
    with open(os.path.join(prepared, key, "index.json")) as f:
        result["index"] = json.load(f)
    return result


def _prepare(corpus: str, run_dir: str, workers: int, tokenizer: str) -> dict:
    from mpmd.lm import load_config
    from mpmd.lm.job import ensure_ray, prepare

    ensure_ray(2)
    cfg = load_config("configs/debug.toml", [f"data.train_files=[{corpus!r}]", f"run.dir={run_dir!r}",
                                             f"data.workers={workers}", f"tokenizer.path={tokenizer!r}"])
    data, _ = prepare(cfg, log=lambda *a: None)
    return data.tokens.index


def run(args) -> int:
    sizes = [float(s) for s in args.sizes.split(",")]
    root = args.dir or tempfile.mkdtemp(prefix="mpmd-bench-data-")
    os.makedirs(root, exist_ok=True)
    mib = 2 ** 20
    rows, results = [], []
    for size in sizes:
        corpus = os.path.join(root, f"corpus-{size:g}mb.txt")
        if not os.path.isfile(corpus) or os.path.getsize(corpus) != int(size * mib):
            progress(f"writing {corpus}")
            write_corpus(corpus, size)
        progress(f"mpmd train on {size:g} MB ({args.steps} steps)")
        r = _train(corpus, os.path.join(root, f"run-{size:g}mb"), args.steps)
        results.append(r)
        p = r["index"]["prepared"]
        rows.append((f"{size:g}", f"{r['peak_rss'] / mib:.0f}", f"{r['peak_rss'] / results[0]['peak_rss']:.3f}",
                     f"{r['index']['tokens']:,}", f"{p['seconds']:.1f}", f"{r['index']['tokens'] / p['seconds']:,.0f}",
                     f"{p['task_peak_rss_bytes'] / mib:.0f}",
                     f"{(p['task_peak_rss_bytes'] - p['task_start_rss_bytes']) / mib:.0f}"))
    print_table(("corpus MB", "controller peak RSS MiB", "vs smallest", "tokens", "prepare s", "tokens/s",
                 "task peak RSS MiB", "task rise MiB"), rows)
    middle = sizes[1] if len(sizes) > 1 else sizes[0]
    corpus = os.path.join(root, f"corpus-{middle:g}mb.txt")
    tokenizer = os.path.join(root, f"run-{middle:g}mb", "tokenizer", "tokenizer.json")
    speed = {}
    for workers in (1, 2):
        progress(f"prepare-data on {middle:g} MB with {workers} worker(s)")
        index = _prepare(corpus, os.path.join(root, f"prep-{workers}"), workers, tokenizer)
        speed[workers] = index["tokens"] / index["prepared"]["seconds"]
    print_table(("workers", "tokens/s", "vs 1 worker"),
                [(str(w), f"{s:,.0f}", f"{s / speed[1]:.2f}x") for w, s in speed.items()])
    return 0
