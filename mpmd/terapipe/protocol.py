"""What token-sliced training asks of a stage module (the TeraPipe protocol).

A token slice travels between stages as the value ``token_slice(x, seq, pos)``: ``x``
(token ids for the first stage, hidden states after it) of sequence ``seq`` (the
microbatch), starting at token ``pos``.  A stage that runs token slices:

* has ``supports_token_slices = True``;
* keeps, per sequence, the keys/values of the slices it has seen, and back-propagates
  their gradient into the earlier slices' backward (``mpmd.models.GPTStage`` does, Note
  [token-sliced context gradients] in ``mpmd/models/gpt.py``);
* has ``reset_contexts()``, which drops whatever context it holds.

For ``token_slices="auto"`` the first stage also tells ``vocab_size`` (token ids to
measure with) and ``max_seq_len`` (the sequence length when ``seq_len`` is not given).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

__all__ = ["token_slice", "is_token_slice", "supports_token_slices", "first_stage_attribute"]


def token_slice(x: torch.Tensor, seq: int, pos: int) -> dict:
    """The value a token-sliced stage takes for one slice: ``x`` of sequence ``seq`` from token ``pos``."""
    return {"x": x, "seq": torch.tensor([seq], dtype=torch.long), "pos": torch.tensor([pos], dtype=torch.long)}


def is_token_slice(value: Any) -> bool:
    return isinstance(value, dict) and "pos" in value and "seq" in value


def supports_token_slices(module: torch.nn.Module) -> bool:
    return bool(getattr(module, "supports_token_slices", False))


def first_stage_attribute(stages: Sequence[torch.nn.Module], name: str) -> Optional[int]:
    """``vocab_size`` or ``max_seq_len`` as the first stage tells it (None if it does not)."""
    value = getattr(stages[0], name, None) if stages else None
    return int(value) if value is not None else None
