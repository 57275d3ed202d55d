"""Models shipped with the package: a small GPT cut into stages (the demo, the benchmarks,
the examples).  The runtime never imports this package; it is an ordinary user of it."""

from .gpt import Block, Embedding, GPTConfig, GPTStage, Head, char_dataset, gpt_stages, lm_loss

__all__ = ["GPTConfig", "Embedding", "Block", "Head", "GPTStage", "gpt_stages", "char_dataset", "lm_loss"]
