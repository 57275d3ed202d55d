"""The ranges of ``mpmd train``'s config numbers and the checks every section runs
(``config.py``'s sections use them): a number out of range is refused by its key at load."""

from __future__ import annotations

import dataclasses
import typing

from ..runtime.limits import FloatRange, IntRange

__all__ = ["config_section", "check_values", "check_choice", "POSITIVE", "STEPS", "STEPS_OR_0", "MAX_LAYERS",
           "MAX_HIDDEN", "MAX_HEADS", "MAX_INTERMEDIATE", "MAX_POSITIONS", "MAX_VOCAB", "MAX_STEPS", "MAX_BATCH_SIZE",
           "MAX_WORKERS", "MAX_MB", "ONE_BYTE_MB", "MAX_PEAK_FLOPS"]

# The maxima of the config's counts (Note [numeric limits] in mpmd/runtime/limits.py; the rest:
# MAX_MICROBATCHES, MAX_SEED, MAX_ACTORS, MAX_TIMEOUT_S from there).  Each is far above any real
# run (Llama 3 405B: 126 layers, hidden 16,384, 128 heads, FFN 53,248, 131,072 positions, ~1M
# steps of 16M tokens) and is there so that a mistyped or hostile number is refused by name at
# load, before the tokenizer, the data or any actor starts, not hours into a run.
MAX_LAYERS = 1_024  # decoder layers; also pipeline stages (each holds at least one layer)
MAX_HIDDEN = 65_536  # hidden size
MAX_HEADS = 1_024  # attention heads (and key/value heads)
MAX_INTERMEDIATE = 262_144  # the MLP's width
MAX_POSITIONS = 1_048_576  # positions, and so data.seq_len
MAX_VOCAB = 2_097_152  # 8x the largest vocabularies in use (262,144); token ids fit uint32
MAX_STEPS = 100_000_000  # optimizer steps, and every count of steps (warm-up, checkpoint/eval/log intervals)
MAX_BATCH_SIZE = 1_048_576  # sequences per step: 512x Llama 3 405B's 2,048 (16M tokens of 8,192)
MAX_WORKERS = 4_096  # Ray Data tokenizing tasks at a time
MAX_MB = 16_384.0  # tokenizer.sample_mb and data.chunk_mb: text held in one process's memory (16 GiB)
ONE_BYTE_MB = 2.0 ** -20  # their least: one byte
MAX_PEAK_FLOPS = 1e18  # per device: 1,000x an H100's dense bf16 (989 TFLOP/s)


def config_section(cls):
    """A config section: a frozen dataclass whose every number has a range in ``LIMITS``
    (checked here, when the class is made, so a new field cannot go unchecked)."""
    cls = dataclasses.dataclass(frozen=True, kw_only=True)(cls)
    hints = typing.get_type_hints(cls)
    numbers = {f.name for f in dataclasses.fields(cls)
               if {int, float} & ({hints[f.name]} | set(typing.get_args(hints[f.name])))}
    assert numbers == set(cls.LIMITS), (f"{cls.__name__}.LIMITS must give a range for each number field: missing "
                                        f"{sorted(numbers - set(cls.LIMITS))}, not fields "
                                        f"{sorted(set(cls.LIMITS) - numbers)}")
    return cls


def check_values(section: str, config) -> None:
    """Every number of a section in its range and every flag a bool, named ``section.key``
    (Note [numeric limits] in mpmd/runtime/limits.py)."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name in config.LIMITS:
            config.LIMITS[f.name].check(f"{section}.{f.name}", value)
        elif f.type == "bool" and not isinstance(value, bool):
            raise ValueError(f"{section}.{f.name} must be true or false, got {value!r}")


def check_choice(section: str, key: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{section}.{key} = {value!r} is not one of {', '.join(map(repr, choices))}")


POSITIVE = FloatRange(0.0, low_open=True)  # a finite number > 0
STEPS = IntRange(1, MAX_STEPS, "optim.steps's maximum (MAX_STEPS)")
STEPS_OR_0 = IntRange(0, MAX_STEPS, "optim.steps's maximum (MAX_STEPS)")
