"""The main job: a character-level GPT trained with interleaved 1F1B on 2 Ray actors.

    python examples/demo.py        # same as `make demo` / `python -m mpmd demo`
"""

from mpmd.cli.demo import run_demo

if __name__ == "__main__":
    raise SystemExit(run_demo())
