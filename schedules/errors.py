"""``ScheduleError``: the error of a schedule that is malformed or cannot finish."""

__all__ = ["ScheduleError"]


class ScheduleError(ValueError):
    """A schedule that is malformed or cannot finish (it would hang at run time)."""
