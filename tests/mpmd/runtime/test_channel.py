"""The step channel (Note [step channel] in actors/channel.py): ordering, failures and
the worker's lock, in one process; then through Ray, the niceness of the actors and
the ordering of a Ray call after steps in flight on the channel."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time

import pytest
import ray
import torch
from torch.nn import functional as F

import mpmd
from actors.channel import ChannelClosed, ChannelServer, accept
from actors.comm import node_ip
from mpmd.runtime.channels import Channels

from tests.models import make_data, make_stages, reference_train, sgd

KEY = bytes(range(32))


class Target:
    """Stands in for a StageWorker: records calls in the order it runs them."""

    def __init__(self) -> None:
        self.calls: list = []
        self.release = threading.Event()  # a "block" call runs until the test sets it

    def __call__(self, method: str, args: tuple):
        if method == "fail":
            raise ValueError(f"failed on {args}")
        if method == "block":
            self.release.wait(60)
        self.calls.append((method, args))
        return (method, args)


def connect(target) -> tuple[ChannelServer, Channels]:
    server = ChannelServer(target, "127.0.0.1", KEY)
    return server, Channels([server.address], KEY)


def test_calls_run_in_order_and_replies_come_back_to_their_calls():
    target = Target()
    server, channels = connect(target)
    try:
        calls = [channels.send(0, "echo", (i, torch.arange(i))) for i in range(20)]
        assert channels.outstanding() == calls
        done = []
        while len(done) < len(calls):
            done += channels.receive([c for c in calls if c not in done], timeout=10)
        for i, call in enumerate(calls):
            method, (n, tensor) = channels.get(call)
            assert (method, n) == ("echo", i) and torch.equal(tensor, torch.arange(i))
        assert [a[0] for _, a in target.calls] == list(range(20))
        assert channels.outstanding() == []
    finally:
        channels.close()


def test_a_large_payload_travels_whole():
    server, channels = connect(Target())
    try:
        big = torch.randn(1 << 19)  # 2 MiB: over the single-write limit
        call = channels.send(0, "echo", (big,))
        assert channels.receive([call], timeout=10) == [call]
        assert torch.equal(channels.get(call)[1][0], big)
    finally:
        channels.close()


def test_a_large_call_neither_blocks_the_controller_nor_deadlocks_with_a_large_reply():
    """Note [channel outbox]: the first call's reply (16 MiB) is written while the controller
    sends a second 16 MiB call and reads nothing; a blocking write would wait forever."""
    server, channels = connect(Target())
    try:
        big = [torch.full((1 << 22,), float(i)) for i in range(2)]  # 16 MiB each
        calls = []
        sender = threading.Thread(target=lambda: calls.extend(channels.send(0, "echo", (b,)) for b in big))
        sender.start()
        sender.join(60)
        assert not sender.is_alive(), "sending the calls blocked"
        assert channels.pending_bytes() > 0  # 32 MiB is more than the sockets hold: the rest waits
        done = []
        while len(done) < 2:
            done += channels.receive([c for c in calls if c not in done], timeout=30)
        assert channels.pending_bytes() == 0
        for call, b in zip(calls, big):
            assert torch.equal(channels.get(call)[1][0], b)
    finally:
        channels.close()


def test_an_exception_in_a_call_is_raised_by_get_and_later_calls_still_run():
    server, channels = connect(Target())
    try:
        bad, good = channels.send(0, "fail", (7,)), channels.send(0, "echo", (8,))
        assert set(channels.receive([bad], timeout=10)) == {bad}
        assert isinstance(channels.failure(bad), ValueError)
        with pytest.raises(ValueError, match=r"failed on \(7,\)"):
            channels.get(bad)
        channels.receive([good], timeout=10)
        assert channels.get(good) == ("echo", (8,))
    finally:
        channels.close()


def _serve_in_a_process(conn) -> None:
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    conn.send(server.address)
    threading.Event().wait(60)  # until the test kills this process


def test_a_dead_server_process_fails_the_pending_calls_and_every_later_call_at_once():
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_serve_in_a_process, args=(child,), daemon=True)
    proc.start()
    try:
        channels = Channels([parent.recv()], KEY)
        slow = channels.send(0, "block", ())
        proc.kill()  # as ray.kill or a crash would
        t0 = time.monotonic()
        assert channels.receive([slow], timeout=10) == [slow]
        assert time.monotonic() - t0 < 5
        assert isinstance(channels.failure(slow), ChannelClosed)
        later = channels.send(0, "echo", ())
        assert channels.receive([later], timeout=0) == [later]
        with pytest.raises(ChannelClosed, match="closed"):
            channels.get(later)
        channels.close()
    finally:
        proc.kill()
        proc.join()


class FakeActor:
    """An actor's end run by the test: a listener that accepts one connection and runs the
    handshake in a thread while the controller's ``Channels`` connects."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self._accepted: list = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        self._accepted.append((conn, *accept(conn, KEY)))

    def connected(self) -> tuple:
        """``(conn, writer, reader)``, once ``Channels`` has connected."""
        self._thread.join(10)
        return self._accepted[0]

    def close(self) -> None:
        for conn, *_ in self._accepted:
            conn.close()
        self.listener.close()


def test_a_reset_connection_fails_the_pending_call_as_a_closed_channel():
    # A killed process's socket may close cleanly or answer with a reset; both are a
    # closed channel to the dispatcher. SO_LINGER 0 makes the close a reset every time.
    actor = FakeActor()
    try:
        channels = Channels([actor.address], KEY)
        peer = actor.connected()[0]
        pending = channels.send(0, "echo", ())
        peer.recv(1)  # the call has arrived; now the peer vanishes
        peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peer.close()
        assert channels.receive([pending], timeout=10) == [pending]
        with pytest.raises(ChannelClosed, match="closed"):
            channels.get(pending)
        channels.close()
    finally:
        actor.close()


def test_a_connection_without_the_key_is_refused():
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    with socket.create_connection(server.address, timeout=10) as stranger:
        stranger.settimeout(10)
        assert len(stranger.recv(16)) == 16  # the server's nonce
        stranger.sendall(b"x" * 48)  # a nonce and a proof made without the key
        assert stranger.recv(1) == b""  # closed by the server
    channels = Channels([server.address], KEY)  # the rightful controller still gets in
    try:
        call = channels.send(0, "echo", (1,))
        assert channels.receive([call], timeout=10) == [call]
    finally:
        channels.close()


def test_a_wait_with_a_timeout_returns_nothing_when_nothing_is_done():
    target = Target()
    server, channels = connect(target)
    try:
        call = channels.send(0, "block", ())
        assert channels.receive([call], timeout=0.05) == []
        target.release.set()
        assert channels.receive([call], timeout=10) == [call]
    finally:
        channels.close()


def test_the_worker_lock_keeps_ray_calls_and_channel_calls_apart():
    from actors.worker import StageWorker

    worker = StageWorker(rank=0, replica=0, num_ranks=1, device="cpu")
    inside, release = threading.Event(), threading.Event()
    order: list[str] = []

    def channel_call():  # holds the lock as a step on the channel's thread does
        with worker.call_lock:
            inside.set()
            release.wait(10)
            order.append("first")

    def ray_call():
        worker.rng_state()  # a public method: waits for the lock
        order.append("second")

    holder = threading.Thread(target=channel_call)
    holder.start()
    assert inside.wait(10)
    caller = threading.Thread(target=ray_call)
    caller.start()
    caller.join(timeout=0.2)
    assert caller.is_alive() and order == []  # blocked on the lock
    release.set()
    holder.join(10)
    caller.join(10)
    assert order == ["first", "second"]
    channels = Channels([tuple(worker.open_channel(KEY, node_ip()))], KEY)
    try:
        call = channels.send(0, "state_dict", ())  # a Ray-only method
        assert channels.receive([call], timeout=10) == [call]
        with pytest.raises(RuntimeError, match="cannot be called over the step channel"):
            channels.get(call)
    finally:
        channels.close()
        worker.shutdown()


def test_step_channel_must_be_a_bool():
    with pytest.raises(ValueError, match="step_channel must be True or False"):
        mpmd.Pipeline(make_stages(2), num_microbatches=2, step_channel="yes")


# -- through Ray --------------------------------------------------------------------------------------


def test_actors_run_at_the_controllers_niceness_and_steps_in_flight_finish_before_a_ray_call(ray_session,
                                                                                           monkeypatch):
    stages = make_stages(2)
    # The middle step goes as Ray tasks between two steps on the channels, all three in
    # flight at once.  Its batch (350000 x 6 float32, 8 MiB) and the last one's go over the
    # channels as they are (Note [channel outbox] in mpmd/runtime/channels.py).
    data = make_data(1, 8) + make_data(1, 350000, seed=2) + make_data(1, 350000, seed=3)
    model, ref_losses = reference_train(stages, data, 4, F.mse_loss, sgd)
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=4, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu") as pipe:
        pids = ray.get([a.pid.remote() for a in pipe.actors])
        if os.geteuid() == 0:  # raising a priority needs CAP_SYS_NICE (Note [worker niceness])
            assert [os.getpriority(os.PRIO_PROCESS, p) for p in pids] == [os.getpriority(os.PRIO_PROCESS, 0)] * 2
        sent = []
        send = Channels.send_built
        monkeypatch.setattr(Channels, "send_built", lambda self, i, message: sent.append(i) or send(self, i, message))
        pending = [pipe.step_async(*data[0])]
        pipe.engine.set_fusion("step", step_channel=False)
        pending.append(pipe.step_async(*data[1]))
        pipe.engine.set_fusion("step", step_channel=True)
        pending.append(pipe.step_async(*data[2]))
        state = pipe.state_dict()  # a Ray call: runs after all three
        losses = [p.result() for p in pending]
    assert sorted(sent) == [0, 0, 1, 1]  # two actors x the first and the last step
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)


def test_payload_free_actors_share_one_message_and_train_as_one_process(ray_session, monkeypatch):
    """Note [bare calls]: 4 ranks x dp=2, the middle ranks' 4 actors get the same bytes each
    step (one pickle), the end ranks their own calls; SGD with momentum equals one process."""
    stages = make_stages(4)
    data = make_data(3, 8)
    model, ref_losses = reference_train(stages, data, 4, F.mse_loss, sgd)
    built = []
    message = Channels.message
    monkeypatch.setattr(Channels, "message", staticmethod(lambda method, args: built.append(args) or message(method, args)))
    with mpmd.Pipeline(stages, schedule="1f1b", num_microbatches=2, dp=2, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu", num_cpus=0.25) as pipe:
        assert pipe.engine.uses_step_channel
        losses = [pipe.step(x, y) for x, y in data]
        assert pipe.engine.last_dispatch.rpcs == 8 and pipe.engine.last_dispatch.bare == 4
        state = pipe.state_dict()
    assert len(built) == len(data)  # one message per step for all four payload-free actors
    assert all(args[1:] == (None, None, None, None) for args in built)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
