"""One stage's forward and another's backward overlapped (Note [overlap turns] in
actors/overlap.py): the turns at exchanges in one process, then inside two gloo processes with
expert parallelism the overlap against forward-then-backward - bit-identical outputs and
gradients, with the two sides' exchanges interleaved."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.exchange import EXCHANGES, exchange
from actors.experts import shard_experts
from actors.overlap import BACKWARD, FORWARD, Overlapper
from actors.stage_exec import Slot, backward_full, backward_input, backward_weight, forward
from mpmd.models.gpt import GPTConfig, gpt_stages, lm_loss

from tests.gloo import run_ranks


class _Done:
    def wait(self) -> None:
        pass


def _side(log: list, name: str, exchanges: int, fail_at: int = -1):
    def run() -> None:
        for k in range(exchanges):
            if k == fail_at:
                raise ValueError(f"{name} failed at {k}")
            log.append((name, k))
            exchange(name, _Done)
        log.append((name, "end"))
    return run


def test_sides_alternate_at_exchanges_forward_first():
    log: list = []
    runner = Overlapper()
    runner.run(_side(log, "f", 3), _side(log, "b", 1))
    assert log == [("f", 0), ("b", 0), ("f", 1), ("b", "end"), ("f", 2), ("f", "end")]
    assert runner.last.turns == 3  # f -> b, b -> f; then b has ended and f runs on alone
    log.clear()
    runner.run(_side(log, "f", 1), _side(log, "b", 3))  # the same thread again
    assert log == [("f", 0), ("b", 0), ("f", "end"), ("b", 1), ("b", 2), ("b", "end")]
    runner.close()


def test_a_side_that_raises_lets_the_other_finish_and_the_error_reaches_the_caller():
    log: list = []
    runner = Overlapper()
    with pytest.raises(ValueError, match="b failed at 1"):
        runner.run(_side(log, "f", 3), _side(log, "b", 3, fail_at=1))
    assert log[-1] == ("f", "end") and runner.failed == BACKWARD  # the interpreter names that part
    with pytest.raises(ValueError, match="f failed at 0"):
        runner.run(_side(log, "f", 3, fail_at=0), _side(log, "b", 2))
    assert log[-1] == ("b", "end") and runner.failed == FORWARD
    runner.run(_side(log, "f", 1), _side(log, "b", 1))
    assert runner.failed is None
    runner.close()


def test_the_backward_side_runs_with_the_callers_grad_mode_and_context():
    from actors.experts import current_loss_scale, loss_scale
    seen = {}
    runner = Overlapper()

    def backward() -> None:
        seen.update(grad=torch.is_grad_enabled(), scale=current_loss_scale(), thread=threading.get_ident())

    with torch.no_grad(), loss_scale(0.25):
        runner.run(lambda: None, backward)
    assert seen == {"grad": False, "scale": 0.25, "thread": seen["thread"]} and seen["thread"] != threading.get_ident()
    runner.close()


# -- two expert-parallel ranks -------------------------------------------------------------------
CFG = GPTConfig(vocab_size=16, seq_len=6, d_model=8, n_heads=2, n_layers=4, n_experts=4, top_k=2, expert_hidden=6)


def _batch(rank: int, microbatch: int) -> tuple:
    g = torch.Generator().manual_seed(10 * rank + microbatch)
    return torch.randint(0, 16, (2, 6), generator=g), torch.randint(0, 16, (2, 6), generator=g)


def _run(rank: int, group, overlapped: bool, split: bool) -> dict:
    """Stage 1's forward of microbatch 0, then stage 0's forward of microbatch 1 with stage 1's
    backward of microbatch 0: overlapped, or one after the other."""
    first, last = gpt_stages(CFG, 2)
    for m in (first, last):
        shard_experts(m, group, rank, 2)
    ahead, behind = Slot(), Slot()
    ahead.inp = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(rank)).requires_grad_(True)
    ahead.inp_grad = [ahead.inp]
    forward(last, ahead, _batch(rank, 0)[1], lm_loss, 0.5, split=split)
    behind.inp = _batch(rank, 1)[0]

    def fwd() -> None:
        forward(first, behind, None, None, 0.5, boundary=True)

    def bwd() -> None:
        backward_input(last, ahead) if split else backward_full(ahead)

    EXCHANGES.recording = True
    EXCHANGES.take()
    turns = 0
    if overlapped:
        runner = Overlapper()
        runner.run(fwd, bwd)
        turns = runner.last.turns
        runner.close()
    else:
        fwd()
        bwd()
    spans, loss = EXCHANGES.take(), ahead.loss.detach()
    if split:
        backward_weight(last, ahead)
    return {"out": behind.out.detach(), "grad_in": ahead.grad_in, "loss": loss, "turns": turns,
            "grads": {n: p.grad for n, p in last.named_parameters()}, "spans": spans}


def _worker(rank: int, group, split: bool) -> dict:
    return {"plain": _run(rank, group, False, split), "overlapped": _run(rank, group, True, split)}


def _kinds(spans: list) -> str:
    """'f' for a forward exchange, 'b' for a backward one, in the order they ended."""
    return "".join("b" if what.endswith("grad") else "f" for _, _, what in sorted(spans, key=lambda s: s[1]))


@pytest.mark.parametrize("split", [False, True], ids=["B", "I"])
def test_overlap_is_bit_identical_to_forward_then_backward_with_interleaved_exchanges(split):
    got = run_ranks(_worker, 2, split)
    for rank in range(2):
        plain, over = got[rank]["plain"], got[rank]["overlapped"]
        assert torch.equal(over["out"], plain["out"]) and torch.equal(over["loss"], plain["loss"])
        assert all(torch.equal(a, b) for a, b in zip(over["grad_in"], plain["grad_in"]))
        assert plain["grads"].keys() == over["grads"].keys()
        for name, g in plain["grads"].items():
            assert torch.equal(over["grads"][name], g), name
        # 2 MoE blocks a stage: the forward's counts, dispatch, combine; the backward's two grads
        assert _kinds(plain["spans"]) == "f" * 6 + "b" * 4
        assert _kinds(over["spans"]) == "fbfbfbfbff"  # issued f b f b f b f b f f
        assert over["turns"] == 9  # the last at f5; at f6 the backward has ended
