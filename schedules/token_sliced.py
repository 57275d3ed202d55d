"""Token-sliced (TeraPipe) schedules: the unit of work is (microbatch, token slice).

Unit ``u = b * num_slices + i`` is slice ``i`` of microbatch ``b``; it is the
schedule's "microbatch" index, so passes, validation and the simulator apply
unchanged.  The schedule must respect one extra rule the generic validator does not
know about, Note [token-sliced order]:

    on every stage, the forwards of a microbatch's slices run in slice order, and
    its backwards in reverse slice order.

Slice ``i`` attends to the keys/values of slices ``< i`` kept on the stage, so its
forward needs theirs first; the backward of slice ``i`` needs the context gradient
that every later slice's backward deposits.  ``check_token_sliced_order`` checks it.
"""

from __future__ import annotations

from .actions import Action, Kind
from .generators import ScheduleInfo, register_schedule
from .errors import ScheduleError
from .placement import looped_stage_to_rank
from .schedule import Schedule
from .validate import validate

__all__ = ["token_sliced_schedule", "check_token_sliced_order", "TOKEN_SLICED_ORDERS", "TOKEN_SLICED_NAMES"]

TOKEN_SLICED_ORDERS = ("gpipe", "1f1b")
TOKEN_SLICED_NAMES = ("terapipe", "terapipe-1f1b")  # the schedules' names, in that order


def token_sliced_schedule(num_ranks: int, num_microbatches: int, num_slices: int, order: str = "gpipe") -> Schedule:
    """The compute schedule of ``num_microbatches`` sequences cut into ``num_slices`` slices each.

    ``order="gpipe"`` (TeraPipe's): every forward in unit order, then every backward in
    reverse unit order.  ``order="1f1b"``: one forward, one backward after a warm-up of
    ``num_ranks - 1 - rank + num_slices - 1`` forwards; backwards go microbatch by
    microbatch, slices in reverse, so a microbatch's activations are released before
    the last one's forwards finish.
    """
    for label, val in (("num_ranks", num_ranks), ("num_microbatches", num_microbatches), ("num_slices", num_slices)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 1:
            raise ValueError(f"{label} must be a positive integer, got {val!r}")
    if order not in TOKEN_SLICED_ORDERS:
        raise ValueError(f"unknown token-sliced order {order!r}; use one of {', '.join(TOKEN_SLICED_ORDERS)}")
    p, s, m = num_ranks, num_slices, num_microbatches * num_slices
    backward_units = [b * s + i for b in range(num_microbatches) for i in reversed(range(s))]
    ranks = []
    for r in range(p):
        if order == "gpipe":
            acts = [Action(r, Kind.F, u) for u in range(m)] + [Action(r, Kind.B, u) for u in reversed(range(m))]
        else:
            # The k-th backward is of unit <= k + s - 1, so s - 1 extra warm-up forwards make it ready.
            warmup = min(p - 1 - r + s - 1, m)
            acts = [Action(r, Kind.F, u) for u in range(warmup)]
            for k in range(m - warmup):
                acts += [Action(r, Kind.F, warmup + k), Action(r, Kind.B, backward_units[k])]
            acts += [Action(r, Kind.B, u) for u in backward_units[m - warmup:]]
        ranks.append(acts)
    name = TOKEN_SLICED_NAMES[TOKEN_SLICED_ORDERS.index(order)]
    sched = Schedule(ranks, m, looped_stage_to_rank(p, 1), name=name)
    return check_token_sliced_order(validate(sched), num_slices)


def check_token_sliced_order(schedule: Schedule, num_slices: int) -> Schedule:
    """Refuse a schedule that breaks Note [token-sliced order]; returns it unchanged."""
    if schedule.num_microbatches % num_slices:
        raise ScheduleError(f"the schedule has {schedule.num_microbatches} units, which is not a multiple of "
                            f"num_slices ({num_slices}); units are microbatch * num_slices + slice")
    for r, acts in enumerate(schedule.ranks):
        done: dict[tuple[int, Kind, int], int] = {}  # (stage, F/B, microbatch) -> last slice seen
        for pos, a in enumerate(acts):
            if a.kind not in (Kind.F, Kind.B, Kind.I, Kind.W):
                continue
            if a.kind in (Kind.I, Kind.W):
                raise ScheduleError(f"rank {r}, position {pos}: {a!r}: token-sliced schedules need fused "
                                    "backwards (B); the split I/W backward is not supported")
            b, i = divmod(a.microbatch, num_slices)
            key = (a.stage, a.kind, b)
            want = (done.get(key, -1) + 1) if a.kind is Kind.F else done.get(key, num_slices) - 1
            if i != want:
                what = "forwards in slice order" if a.kind is Kind.F else "backwards in reverse slice order"
                raise ScheduleError(f"rank {r}, position {pos}: {a!r} is slice {i} of microbatch {b}, but stage "
                                    f"{a.stage} must run its slice {want} first: a microbatch's slices run their "
                                    f"{what} (Note [token-sliced order])")
            done[key] = i
    return schedule


register_schedule(ScheduleInfo(
    name="terapipe",
    build=lambda p, m, v: token_sliced_schedule(p, m, 1, "gpipe").replace(name="terapipe"),
    description="TeraPipe token slices: forwards in order, backwards reversed (units = microbatch x slice)",
))
