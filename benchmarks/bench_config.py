"""The bench GPT and its options, shared by ``python -m mpmd bench steps``, ``bench predict``
and ``bench auto``: the model, its batches and optimizer, where its actors go, and the
command-line options that make a ``BenchConfig``."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Optional

import torch

__all__ = ["BenchConfig", "stages_per_rank", "bench_model", "bench_optimizer", "placement", "add_config_arguments",
           "config_from_args"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b")
    actors: int = 2
    microbatches: int = 8
    steps: int = 8  # measured steps per row (median reported)
    warmup: int = 2
    batch_size: int = 32
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 4
    torch_pipelining: bool = True
    rounds: int = 4  # alternating rounds of torch and our fit loop; "vs torch" of the fit row: median round ratio
    dispatch_microbatches: tuple[int, ...] = (8, 32, 128)  # empty: skip table 2
    dispatch_steps: int = 3
    device: str = "cpu"  # "cuda": the single process and the actors on the GPU (they share it)

    def __post_init__(self) -> None:
        import schedules

        for name in self.schedules:
            schedules.schedule_info(name)  # raises for an unknown name
        for field in ("actors", "microbatches", "steps", "batch_size", "seq_len", "d_model", "n_layers",
                      "dispatch_steps", "rounds"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.batch_size % self.microbatches:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by microbatches "
                             f"({self.microbatches}); use {self.microbatches * max(1, self.batch_size // self.microbatches)}")
        if any(m < 1 for m in self.dispatch_microbatches):
            raise ValueError(f"dispatch_microbatches must be positive, got {self.dispatch_microbatches}")
        for name in self.schedules:
            if self.actors * stages_per_rank(name) > self.n_layers:
                raise ValueError(f"{name} on {self.actors} actors needs {self.actors * stages_per_rank(name)} "
                                 f"stages but the model has n_layers={self.n_layers}; raise n_layers")


def stages_per_rank(schedule: str) -> int:
    import schedules

    return schedules.schedule_info(schedule).default_stages_per_rank


def bench_model(cfg: BenchConfig, num_stages: int):
    """The bench GPT cut into ``num_stages`` stages, and its batches (deterministic)."""
    from mpmd.models import GPTConfig, char_dataset, gpt_stages
    from .harness import demo_text

    vocab, batches = char_dataset(demo_text(), seq_len=cfg.seq_len, batch_size=cfg.batch_size,
                                  steps=cfg.warmup + cfg.steps)
    gcfg = GPTConfig(vocab_size=len(vocab), seq_len=cfg.seq_len, d_model=cfg.d_model, n_heads=4,
                     n_layers=cfg.n_layers)
    return gpt_stages(gcfg, num_stages), batches


def bench_optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3)


def placement(cfg: BenchConfig) -> dict:
    """The Pipeline options that put the bench's actors on ``cfg.device`` (sharing one GPU)."""
    return {"device": "cuda", "num_gpus": 1.0 / cfg.actors} if cfg.device == "cuda" else {"device": "cpu"}


# -- the command-line options ----------------------------------------------------------------------------
def add_config_arguments(p, *, schedules: bool = True, microbatches: bool = True) -> None:
    """The options every bench of the bench GPT takes; ``schedules``, ``microbatches``: also those
    (``bench auto`` chooses both itself)."""
    if schedules:
        p.add_argument("--schedule", default="1f1b,interleaved-1f1b",
                       help="comma-separated schedules (default: 1f1b,interleaved-1f1b)")
    p.add_argument("--actors", type=int, default=2, help="pipeline processes (default: 2)")
    if microbatches:
        p.add_argument("--microbatches", "-m", type=int, default=8, help="microbatches per step (default: 8)")
    p.add_argument("--steps", type=int, default=8, help="measured steps per row; the median is shown (default: 8)")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps first (default: 2)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per step (default: 32)")
    p.add_argument("--d-model", type=int, default=128, help="GPT width (default: 128)")
    p.add_argument("--layers", type=int, default=4, help="GPT blocks (default: 4)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default: 64)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cuda: the single process and the actors on the GPU (actors share it: num_gpus=1/actors)")


# argparse dest -> BenchConfig field
_FIELDS = {"actors": "actors", "microbatches": "microbatches", "steps": "steps", "warmup": "warmup",
           "batch_size": "batch_size", "d_model": "d_model", "layers": "n_layers", "seq_len": "seq_len",
           "device": "device"}


def config_from_args(args, **fields: Any) -> Optional[BenchConfig]:
    """The ``BenchConfig`` of the parsed options (``fields``: more of its fields), or None once the
    reason it is refused is printed."""
    given = {field: getattr(args, dest) for dest, field in _FIELDS.items() if hasattr(args, dest)}
    if hasattr(args, "schedule"):
        given["schedules"] = tuple(s.strip() for s in args.schedule.split(",") if s.strip())
    try:
        return BenchConfig(**given, **fields)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
