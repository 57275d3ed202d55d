"""``ScheduleView``: what the modules below ``schedule`` (``text``, the simulators,
``render``, ``validate``) read of a ``Schedule``.  They take it as this protocol, so none of them
imports ``schedule``, not even for annotations (Note [import layers])."""

from __future__ import annotations

from typing import Protocol, Sequence

from .actions import Action, Kind

__all__ = ["ScheduleView"]


class ScheduleView(Protocol):
    @property
    def ranks(self) -> Sequence[Sequence[Action]]: ...

    @property
    def num_stages(self) -> int: ...

    @property
    def num_microbatches(self) -> int: ...

    @property
    def stage_to_rank(self) -> Sequence[int]: ...

    @property
    def forward_only(self) -> bool: ...

    @property
    def backward_kind(self) -> dict[int, Kind]: ...

    def backward_of(self, stage: int, microbatch: int) -> Kind: ...
