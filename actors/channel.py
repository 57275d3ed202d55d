"""The step channel: one persistent socket from the controller to an actor.

Note [step channel]: a Ray task costs the controller a few hundred microseconds to
issue (argument checks, task spec, scheduling through the core worker) and the
actor as much to receive, every step.  With ``fusion="step"`` the calls are always
the same one, so the controller instead keeps a TCP connection per actor, opened
once after set-up, and writes each call as one framed message: a few tens of
microseconds.  A thread in the actor reads the calls in order and runs them, and
writes each result (or the exception) back in the same order.  Everything else
(set-up, checkpoints, probes) still goes through Ray, and the worker's lock keeps a
Ray call from running while a channel call is (``StageWorker`` serialises both).

Failure: a dead actor closes its end of the socket, which the controller sees at
once; a hung one is found by the step timeout or by a peer's communication timeout,
as before.  The connection is accepted only from a peer that first sends the token
the controller received over Ray.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading
import traceback
from typing import Any, Callable, Optional

__all__ = ["ChannelServer", "send_message", "recv_message", "frame", "message_parts", "ChannelClosed", "OK", "FAILED"]

_LENGTH = struct.Struct("!Q")
OK, FAILED = 0, 1
_ACCEPT_TIMEOUT_S = 60.0


class ChannelClosed(ConnectionError):
    """The other end of a step channel went away."""


def frame(obj: Any) -> bytes:
    """``obj`` as one message: built once, the same bytes can go to many peers."""
    return b"".join(message_parts(obj))


def message_parts(obj: Any) -> tuple[bytes, bytes]:
    """``obj`` as a message in two parts, its length header and its pickled bytes, so a large
    payload is not copied once more to join them."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(data)), data


def send_message(sock: socket.socket, obj: Any) -> None:
    head, data = message_parts(obj)
    if len(data) < 65536:  # one write: one segment with TCP_NODELAY
        sock.sendall(head + data)
    else:  # no concatenated copy of a large payload
        sock.sendall(head)
        sock.sendall(data)


def recv_message(sock: socket.socket) -> Any:
    (n,) = _LENGTH.unpack(_recv_exactly(sock, _LENGTH.size))
    return pickle.loads(_recv_exactly(sock, n))


def _recv_exactly(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("the step channel was closed by its peer")
        got += k
    return buf


class ChannelServer:
    """The actor's end: listens on ``host``, serves one connection in a daemon thread."""

    def __init__(self, call: Callable[[str, tuple], Any], host: str, token: bytes) -> None:
        self._call, self._token = call, token
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_TIMEOUT_S)
        self.address = (host, self._listener.getsockname()[1])
        self._thread = threading.Thread(target=self._serve, name="mpmd-step-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn = self._accept()
        finally:
            self._listener.close()
        if conn is None:
            return
        with conn:
            while True:
                try:
                    method, args = recv_message(conn)
                except (ChannelClosed, OSError):
                    return  # the controller closed the channel (shutdown) or went away
                try:
                    reply = (OK, self._call(method, args))
                except BaseException as e:  # noqa: BLE001 - the controller raises it
                    reply = (FAILED, _picklable(e))
                try:
                    send_message(conn, reply)
                except OSError:
                    return

    def _accept(self) -> Optional[socket.socket]:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # timed out: nobody came (the controller failed during set-up)
                return None
            conn.settimeout(10.0)
            try:
                ok = bytes(_recv_exactly(conn, len(self._token))) == self._token
            except (ChannelClosed, OSError):
                ok = False
            if ok:
                conn.settimeout(None)
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return conn
            conn.close()

    def close(self) -> None:
        try:
            self._listener.close()
        except OSError:
            pass


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.dumps(exc)
        return exc
    except Exception:  # noqa: BLE001 - an exception that does not pickle travels as text
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{''.join(traceback.format_exception(exc))}")
