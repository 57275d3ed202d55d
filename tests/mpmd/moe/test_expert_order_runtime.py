"""The programs the order model accepts with the EP all-to-alls (Note [expert all-to-alls in the
order model] in schedules/expert_order.py) run in NCCL's posted order (``transport="nccl-order"``:
each pair's messages in posted order, each blocking until matched) at pp=2 x dp=2 x ep=2 on CPU
actors, equal to one process: the check ran before launch and at install, and nothing hung."""

from __future__ import annotations

import pytest

from mpmd.models.gpt import gpt_stages
from tests.mpmd.moe.test_expert_parallel import _compare, _config


@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_ep2_in_nccl_order_equals_one_process(ray_session, schedule):
    _compare(gpt_stages(_config(), 2), schedule, dp=2, ep=2, transport="nccl-order", aux=0.01)
