"""The (schedule, p, m, v) sweep every generator is checked over, shared by the schedule tests."""

from __future__ import annotations

import pytest

from schedules import get_schedule, lower


def _sweep():
    """(name, p, m, v) for every valid combination; v is None for the single-stage schedules."""
    cases = []
    for p in (1, 2, 3, 4, 8):
        for m in range(1, 13):
            cases.append(("gpipe", p, m, None))
            cases.append(("1f1b", p, m, None))
            for v in (1, 2, 3):
                if m % p == 0:
                    cases.append(("interleaved-1f1b", p, m, v))
    return cases


SWEEP = _sweep()


def case_id(case) -> str:
    """The test id of a sweep case, e.g. ``interleaved-1f1b-p2-m4-v2``."""
    name, p, m, v = case
    return f"{name}-p{p}-m{m}" + ("" if v is None else f"-v{v}")


@pytest.fixture(scope="module")
def built():
    """Every generated schedule of the sweep with its two lowerings, built once."""
    out = {}
    for case in SWEEP:
        s = get_schedule(case[0], case[1], case[2], case[3])
        out[case] = (s, lower(s), lower(s, allreduce=True))
    return out
