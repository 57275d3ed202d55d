"""The controller's ends of the actors' step channels (Note [step channel] in actors/channel.py)."""

from __future__ import annotations

import os
import select
import socket
import time
from typing import Any, NamedTuple, Optional

from actors.channel import FAILED, ChannelClosed, frame, recv_message, send_frame, send_message

__all__ = ["Call", "Channels"]

_CONNECT_TIMEOUT_S = 30.0


class Call(NamedTuple):
    """One call sent over actor ``actor``'s channel; replies come back in ``seq`` order."""

    actor: int
    seq: int


class Channels:
    """One connected socket per actor; calls go out in order and their replies are kept
    until asked for, like Ray futures."""

    def __init__(self, addresses: list[tuple[str, int]], token: bytes) -> None:
        self._socks: list[Optional[socket.socket]] = []
        try:
            for host, port in addresses:
                sock = socket.create_connection((host, port), timeout=_CONNECT_TIMEOUT_S)
                sock.sendall(token)
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socks.append(sock)
        except BaseException:
            self.close()
            raise
        n = len(self._socks)
        self._sent, self._read = [0] * n, [0] * n
        self._replies: list[dict[int, tuple]] = [{} for _ in range(n)]
        self._dead: list[Optional[BaseException]] = [None] * n

    @staticmethod
    def new_token() -> bytes:
        return os.urandom(16)

    def send(self, actor: int, method: str, args: tuple) -> Call:
        return self._send(actor, send_message, (method, args))

    @staticmethod
    def message(method: str, args: tuple) -> bytes:
        """A call as bytes, built once for ``send_built`` to many actors."""
        return frame((method, args))

    def send_built(self, actor: int, message: bytes) -> Call:
        """Send a call built by ``message``: a step's payload-free actors all get the same bytes."""
        return self._send(actor, send_frame, message)

    def _send(self, actor: int, write, what) -> Call:
        call = Call(actor, self._sent[actor])
        self._sent[actor] += 1
        if self._dead[actor] is None:
            try:
                write(self._socks[actor], what)
            except OSError as e:
                self._mark_dead(actor, e)
        else:  # the channel is gone: the call fails at once, never waits
            self._mark_dead(actor, self._dead[actor])
        return call

    def done(self, call: Call) -> bool:
        return call.seq in self._replies[call.actor]

    def outstanding(self) -> list[Call]:
        return [Call(a, s) for a in range(len(self._socks)) for s in range(self._read[a], self._sent[a])]

    def receive(self, calls: list[Call], timeout: Optional[float]) -> list[Call]:
        """Read replies until one of ``calls`` is done or ``timeout`` passes; those done."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [c for c in calls if self.done(c)]
            if done:
                return done
            waiting = {self._socks[c.actor]: c.actor for c in calls}
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select(list(waiting), [], [], remaining)
            if not readable:
                return []
            for sock in readable:
                self._read_one(waiting[sock])

    def _read_one(self, actor: int) -> None:
        try:
            reply = recv_message(self._socks[actor])
        except (ChannelClosed, OSError, EOFError) as e:
            self._mark_dead(actor, e)
            return
        self._replies[actor][self._read[actor]] = reply
        self._read[actor] += 1

    def _mark_dead(self, actor: int, error: BaseException) -> None:
        if isinstance(error, ChannelClosed):
            closed = error
        else:  # a reset or a broken pipe: the peer went away as surely as with a clean close
            closed = ChannelClosed(f"the step channel to actor {actor} closed: {error}")
        self._dead[actor] = closed
        for seq in range(self._read[actor], self._sent[actor]):
            self._replies[actor][seq] = (FAILED, closed)
        self._read[actor] = self._sent[actor]
        sock, self._socks[actor] = self._socks[actor], None
        if sock is not None:
            sock.close()

    def failure(self, call: Call) -> Optional[BaseException]:
        status, value = self._replies[call.actor][call.seq]
        return value if status == FAILED else None

    def get(self, call: Call) -> Any:
        """The reply of a done call (raised if it failed); it is forgotten after."""
        status, value = self._replies[call.actor].pop(call.seq)
        if status == FAILED:
            raise value
        return value

    def close(self) -> None:
        for i, sock in enumerate(self._socks):
            if sock is not None:
                sock.close()
            self._socks[i] = None

