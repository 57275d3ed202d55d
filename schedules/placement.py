"""Stage -> rank maps of the registered schedules (``Schedule.stage_to_rank``)."""

__all__ = ["looped_stage_to_rank", "v_stage_to_rank"]


def looped_stage_to_rank(num_ranks: int, stages_per_rank: int) -> tuple[int, ...]:
    """Stage s on rank s % p (GPipe, 1F1B, interleaved 1F1B)."""
    return tuple(s % num_ranks for s in range(num_ranks * stages_per_rank))


def v_stage_to_rank(num_ranks: int) -> tuple[int, ...]:
    """V shape: stage s and 2p-1-s on the same rank (ZB-V, DualPipeV)."""
    down = list(range(num_ranks))
    return tuple(down + down[::-1])
