"""Timeouts turn a hang into an error: a peer stuck in its forward (``comm_timeout_s``:
the actor waiting on it gives up), and a step that runs too long (``step_timeout_s``).
Either way the error names what waited, it comes within the timeout plus a margin for a
loaded machine, and none of the pipeline's actors is left."""

from __future__ import annotations

import threading
import time

import pytest
from torch import nn
from torch.nn import functional as F

import mpmd

from tests.models import make_data, make_stages, sgd

MARGIN_S = 15.0  # start-up of the error path on a loaded 2-core machine


class Stalls(nn.Module):
    """A stage whose forward blocks after ``calls`` calls (a stuck kernel or data source)."""

    def __init__(self, inner: nn.Module, calls: int, seconds: float) -> None:
        super().__init__()
        self.inner, self.calls, self.seconds = inner, calls, seconds

    def forward(self, x):
        if self.calls <= 0:
            threading.Event().wait(self.seconds)
        self.calls -= 1
        return self.inner(x)


def run_until_error(pipe: mpmd.Pipeline, error: type, match: str) -> float:
    data = make_data(3, 8)
    start = time.monotonic()
    with pytest.raises(error, match=match):
        for x, y in data:
            pipe.step(x, y)
    elapsed = time.monotonic() - start
    assert pipe.actors == [], "the pipeline's actors were not torn down"
    return elapsed


@pytest.mark.parametrize("transport, says", [
    ("gloo", ""),  # gloo's own timeout
    # NCCL's order (here its CPU emulation): the actor watches the receive itself (Note [stuck operations]),
    # before NCCL's watchdog would take the process down, and names it.
    ("nccl-order", r"CommTimeout: a receive from actor 0 did not complete within 4s")])
def test_a_peer_stuck_in_its_forward_becomes_an_error_after_comm_timeout_s(ray_session, transport, says):
    comm_timeout_s = 4.0
    stages = make_stages(2)
    stages[0] = Stalls(stages[0], calls=2, seconds=600)  # the first step's 2 microbatches pass, then it stalls
    pipe = mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd,
                         device="cpu", comm_timeout_s=comm_timeout_s, transport=transport)
    with pipe:
        elapsed = run_until_error(pipe, mpmd.StageFailedError, r"rank 1 .*step 1.*RECV_F.*" + says)
    print(f"\nstuck peer: error after {elapsed:.1f}s (comm_timeout_s={comm_timeout_s})")
    assert comm_timeout_s * 0.75 < elapsed < comm_timeout_s + MARGIN_S


def test_a_step_over_step_timeout_s_becomes_an_error(ray_session):
    step_timeout_s = 2.0
    stages = make_stages(2)
    stages[1] = Stalls(stages[1], calls=2, seconds=600)
    pipe = mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd,
                         device="cpu", comm_timeout_s=60.0, step_timeout_s=step_timeout_s)
    with pipe:
        elapsed = run_until_error(pipe, mpmd.PipelineTimeoutError, r"step 1 did not finish within 2.0s")
    print(f"\nslow step: error after {elapsed:.1f}s (step_timeout_s={step_timeout_s})")
    assert step_timeout_s * 0.75 < elapsed < step_timeout_s + MARGIN_S
