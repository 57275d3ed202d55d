"""The step channel's authentication (Note [step channel] in actors/channel.py): every
frame's tag, sequence number and length are checked before anything is unpickled, in
both directions; what fails to decode or pickle fails one call, not the channel; and an
authentication failure reaches the user as such, never as a dead actor."""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import tracemalloc
import types

import pytest
import torch
from torch.nn import functional as F

import actors.channel as channel
import mpmd
from actors.channel import (MAX_FRAME_BYTES, OK, REFUSED, ChannelAuthError, ChannelClosed, ChannelServer,
                            FrameWriter, connect, decode, encode)
from mpmd.runtime.channels import Channels

from tests.models import make_data, make_stages, sgd
from tests.mpmd.runtime.test_channel import KEY, FakeActor

_UNPICKLED: list = []  # what Forged's unpickling ran: it must stay empty


def _ran_on_unpickling(what: str) -> str:
    _UNPICKLED.append(what)
    return what


class Forged:
    """Unpickling it runs code, as a forged frame's would."""

    def __reduce__(self):
        return _ran_on_unpickling, ("forged",)


def _only_on_the_controller(name: str):
    raise ModuleNotFoundError(f"No module named {name!r}")


class Undecodable:
    """Pickles on the controller, but its unpickling fails, as a class the actor cannot import would."""

    def __reduce__(self):
        return _only_on_the_controller, ("controller_only_module",)


class Target:
    def __init__(self) -> None:
        self.calls: list = []

    def __call__(self, method: str, args: tuple):
        self.calls.append((method, args))
        if method == "unpicklable":
            return lambda: None
        return (method, args)


@pytest.fixture
def spy_loads(monkeypatch):
    """Every payload the channel module unpickles."""
    loaded: list = []
    _UNPICKLED.clear()

    def loads(data, *a, **k):
        loaded.append(bytes(data))
        return pickle.loads(data, *a, **k)

    monkeypatch.setattr(channel, "pickle", types.SimpleNamespace(dumps=pickle.dumps, loads=loads,
                                                                 HIGHEST_PROTOCOL=pickle.HIGHEST_PROTOCOL))
    return loaded


def frame_bytes(writer: FrameWriter, obj) -> bytes:
    return b"".join(bytes(p) for p in writer.parts(encode(obj, "a test frame")))


def flip_tag_bit(frame: bytes) -> bytes:
    return frame[:8] + bytes([frame[8] ^ 1]) + frame[9:]  # the tag follows the 8-byte length


def refusal(sock: socket.socket, reader) -> str:
    """The server's last reply: a REFUSED one, after which it closes."""
    status, text = decode(reader.read(sock))
    assert status == REFUSED
    sock.settimeout(10)
    assert sock.recv(1) == b""  # closed by the server
    return text


def controller_with_fake_actor() -> tuple[Channels, FakeActor, tuple]:
    actor = FakeActor()
    channels = Channels([actor.address], KEY)
    return channels, actor, actor.connected()


# -- frames the actor receives ---------------------------------------------------------------------


def test_a_frame_with_a_wrong_tag_is_never_unpickled_and_the_actor_refuses_it(spy_loads):
    target = Target()
    server = ChannelServer(target, "127.0.0.1", KEY)
    sock, writer, reader = connect(server.address, KEY, 10)
    with sock:
        forged = frame_bytes(writer, ("echo", (Forged(),)))
        sock.sendall(flip_tag_bit(forged))
        assert "failed its HMAC check" in refusal(sock, reader)
    assert _UNPICKLED == [] and target.calls == []
    assert forged[40:] not in spy_loads  # the payload after the 40-byte header


def test_a_replayed_frame_is_refused_and_runs_once():
    target = Target()
    server = ChannelServer(target, "127.0.0.1", KEY)
    sock, writer, reader = connect(server.address, KEY, 10)
    with sock:
        call = frame_bytes(writer, ("echo", (1,)))
        sock.sendall(call)
        assert decode(reader.read(sock)) == (OK, ("echo", (1,)))
        sock.sendall(call)  # the same bytes again: its sequence number is past
        assert "frame 1 " in refusal(sock, reader)
    assert target.calls == [("echo", (1,))]


def test_a_frame_recorded_on_another_connection_is_refused():
    first = ChannelServer(Target(), "127.0.0.1", KEY)
    sock, writer, _ = connect(first.address, KEY, 10)
    recorded = frame_bytes(writer, ("echo", (1,)))  # sequence 0, under the first connection's key
    sock.close()
    target = Target()
    second = ChannelServer(target, "127.0.0.1", KEY)
    sock, _, reader = connect(second.address, KEY, 10)
    with sock:
        sock.sendall(recorded)
        assert "failed its HMAC check" in refusal(sock, reader)
    assert target.calls == []


def test_an_oversize_length_header_is_refused_without_allocating():
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    sock, _, reader = connect(server.address, KEY, 10)
    with sock:
        tracemalloc.start()
        try:
            sock.sendall(struct.pack("!Q32s", MAX_FRAME_BYTES + 1, bytes(32)))
            text = refusal(sock, reader)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert "1,073,741,825 bytes, over the limit of 1,073,741,824" in text
    assert peak < 16 << 20


def test_a_peer_without_the_key_is_refused_at_the_handshake_and_the_controller_still_gets_in():
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    with pytest.raises(ChannelClosed, match="closed the step channel during the handshake: it refused"):
        Channels([server.address], bytes(32))
    channels = Channels([server.address], KEY)
    try:
        call = channels.send(0, "echo", (1,))
        assert channels.receive([call], timeout=10) == [call]
        assert channels.get(call) == ("echo", (1,))
    finally:
        channels.close()


# -- frames the controller receives ----------------------------------------------------------------


def test_an_actor_that_cannot_prove_the_key_is_refused_at_connect():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        def impostor():
            conn, _ = listener.accept()
            with conn:
                conn.sendall(bytes(16))
                conn.recv(48)
                conn.sendall(bytes(32))  # no proof of the key
                conn.recv(1)

        thread = threading.Thread(target=impostor, daemon=True)
        thread.start()
        with pytest.raises(ChannelAuthError, match=r"authentication failed on the step channel to actor 0 "
                                                   r"\(127\.0\.0\.1:\d+\): the peer did not prove it holds the "
                                                   r"pipeline's key"):
            Channels([listener.getsockname()[:2]], KEY)
        thread.join(10)


def test_a_reply_with_a_wrong_tag_is_never_unpickled_and_fails_as_authentication(spy_loads):
    channels, actor, (conn, writer, _) = controller_with_fake_actor()
    try:
        call = channels.send(0, "echo", ())
        forged = frame_bytes(writer, (OK, Forged()))
        conn.sendall(flip_tag_bit(forged))
        assert channels.receive([call], timeout=10) == [call]
        error = channels.failure(call)
        assert type(error) is ChannelAuthError
        with pytest.raises(ChannelAuthError, match=r"authentication failed on the step channel to actor 0 "
                                                   r"\(127\.0\.0\.1:\d+\): frame 0 \(\d+ bytes\) failed its HMAC"):
            channels.get(call)
    finally:
        channels.close()
        actor.close()
    assert _UNPICKLED == [] and spy_loads == []


def test_a_replayed_or_reflected_reply_fails_as_authentication():
    channels, actor, (conn, writer, _) = controller_with_fake_actor()
    try:
        calls = [channels.send(0, "echo", (i,)) for i in range(2)]
        reply = frame_bytes(writer, (OK, "first"))
        conn.sendall(reply + reply)
        assert channels.receive(calls, timeout=10)
        channels.receive([calls[1]], timeout=10)
        assert channels.get(calls[0]) == "first"
        with pytest.raises(ChannelAuthError, match=r"to actor 0 \(127\.0\.0\.1:\d+\): frame 1 .* failed its HMAC"):
            channels.get(calls[1])
    finally:
        channels.close()
        actor.close()
    channels, actor, (conn, _, _) = controller_with_fake_actor()
    try:
        call = channels.send(0, "echo", (1,))
        conn.settimeout(10)
        head = conn.recv(40, socket.MSG_WAITALL)  # the controller's frame, sent back as if it were a reply
        conn.sendall(head + conn.recv(struct.unpack("!Q", head[:8])[0], socket.MSG_WAITALL))
        assert channels.receive([call], timeout=10) == [call]
        with pytest.raises(ChannelAuthError, match=r"to actor 0 \(127\.0\.0\.1:\d+\): frame 0 .* failed its HMAC"):
            channels.get(call)
    finally:
        channels.close()
        actor.close()


def test_an_oversize_reply_header_fails_as_authentication():
    channels, actor, (conn, _, _) = controller_with_fake_actor()
    try:
        call = channels.send(0, "echo", ())
        conn.sendall(struct.pack("!Q32s", 1 << 62, bytes(32)))
        assert channels.receive([call], timeout=10) == [call]
        with pytest.raises(ChannelAuthError, match=r"to actor 0 \(127\.0\.0\.1:\d+\): frame 0 claims "
                                                   r"4,611,686,018,427,387,904 bytes, over the limit"):
            channels.get(call)
    finally:
        channels.close()
        actor.close()


# -- what does not decode or pickle fails one call ------------------------------------------------


def test_a_call_that_does_not_unpickle_in_the_actor_fails_alone_and_the_next_call_runs():
    target = Target()
    server = ChannelServer(target, "127.0.0.1", KEY)
    channels = Channels([server.address], KEY)
    try:
        bad, good = channels.send(0, "echo", (Undecodable(),)), channels.send(0, "echo", (2,))
        channels.receive([bad], timeout=10)
        with pytest.raises(RuntimeError, match="the actor could not decode a call from the step channel "
                                               r"\(ModuleNotFoundError: No module named 'controller_only_module'\)"):
            channels.get(bad)
        channels.receive([good], timeout=10)
        assert channels.get(good) == ("echo", (2,))
        assert target.calls == [("echo", (2,))]
    finally:
        channels.close()


def test_a_reply_that_does_not_pickle_fails_alone_and_the_next_call_runs():
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    channels = Channels([server.address], KEY)
    try:
        bad, good = channels.send(0, "unpicklable", ()), channels.send(0, "echo", (3,))
        channels.receive([bad], timeout=10)
        assert channels.failure(bad) is not None
        with pytest.raises(RuntimeError, match="the reply to 'unpicklable' cannot go over the step channel: it does "
                                               "not pickle"):
            channels.get(bad)
        channels.receive([good], timeout=10)
        assert channels.get(good) == ("echo", (3,))
    finally:
        channels.close()


def test_a_call_that_does_not_pickle_raises_at_send_and_sends_nothing():
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    channels = Channels([server.address], KEY)
    try:
        with pytest.raises(TypeError, match="the call 'echo' to actor 0 cannot go over the step channel: it does not "
                                            "pickle"):
            channels.send(0, "echo", (lambda: None,))
        assert channels.outstanding() == []
        call = channels.send(0, "echo", (4,))
        channels.receive([call], timeout=10)
        assert channels.get(call) == ("echo", (4,))
    finally:
        channels.close()


def test_a_call_over_the_frame_limit_is_refused_at_send(monkeypatch):
    server = ChannelServer(Target(), "127.0.0.1", KEY)
    channels = Channels([server.address], KEY)
    monkeypatch.setattr(channel, "MAX_FRAME_BYTES", 1000)
    try:
        with pytest.raises(ValueError, match=r"the call 'echo' to actor 0 is [\d,]+ bytes pickled, over the step "
                                             r"channel's limit of 1,000 .* set step_channel=False"):
            channels.send(0, "echo", (bytes(2000),))
        assert channels.outstanding() == []
        call = channels.send(0, "echo", (5,))
        channels.receive([call], timeout=10)
        assert channels.get(call) == ("echo", (5,))
    finally:
        channels.close()


# -- through Ray --------------------------------------------------------------------------------------


def test_through_ray_a_call_that_cannot_be_sent_starts_no_actor_and_a_forged_frame_is_no_dead_actor(ray_session,
                                                                                                   monkeypatch):
    """The actors, on the controller's node, listen on loopback.  A step whose call to one
    actor cannot be encoded raises before any actor gets its call, and the next step runs.
    Then the controller's frames are made to fail their check (as an attacker's would):
    each actor refuses, and the user gets a PipelineError that says so, not ActorDiedError."""
    addresses, sent = [], []
    init, send_built, encode_call = Channels.__init__, Channels.send_built, Channels.encode
    monkeypatch.setattr(Channels, "__init__", lambda self, a, key: addresses.extend(a) or init(self, a, key))
    monkeypatch.setattr(Channels, "send_built", lambda self, i, message: sent.append(i) or send_built(self, i, message))

    def refuse_the_last_actor(actor: int, method: str, args: tuple) -> bytes:
        if actor == 1:
            return encode_call(actor, method, (lambda: None,))  # does not pickle
        return encode_call(actor, method, args)

    data = make_data(3, 8)
    with mpmd.Pipeline(make_stages(2), schedule="1f1b", num_microbatches=2, loss_fn=F.mse_loss, optimizer=sgd,
                       device="cpu") as pipe:
        assert [host for host, _ in addresses] == ["127.0.0.1"] * 2
        monkeypatch.setattr(Channels, "encode", staticmethod(refuse_the_last_actor))
        with pytest.raises(TypeError, match="the call 'run_call' to actor 1 cannot go over the step channel"):
            pipe.step(*data[0])
        assert sent == []  # actor 0's call was encoded, but not sent
        monkeypatch.setattr(Channels, "encode", staticmethod(encode_call))
        assert torch.isfinite(torch.tensor(pipe.step(*data[1])))
        assert sorted(sent) == [0, 1]
        parts = FrameWriter.parts
        monkeypatch.setattr(FrameWriter, "parts", lambda self, payload: (flip_tag_bit(b"".join(parts(self, payload))),))
        with pytest.raises(mpmd.PipelineError, match=r"authentication failed on the step channel to actor \d "
                                                     r"\(127\.0\.0\.1:\d+\): the actor refused a frame from the "
                                                     r"controller: frame \d+ .*failed its HMAC check.* the actor did "
                                                     r"not die") as info:
            pipe.step(*data[2])
        assert not isinstance(info.value, mpmd.ActorDiedError)
        assert isinstance(info.value.__cause__, ChannelAuthError)
