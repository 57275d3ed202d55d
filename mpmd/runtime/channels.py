"""The controller's ends of the actors' step channels (Note [step channel] in actors/channel.py).

Note [channel outbox]
~~~~~~~~~~~~~~~~~~~~~
The controller never blocks writing a call.  An actor's channel thread reads its next call
only after it has run the previous one and written the reply.  So a call larger than what
the two sockets' buffers hold (a batch of a few MiB) could not be written while the actor
runs its step.  A blocking write would stop the controller from issuing the other actors'
calls, and it would deadlock if the actor were writing a large reply that the controller
does not read.

Each call is therefore queued on its actor's outbox, which takes what the socket accepts at
once (``MSG_DONTWAIT``).  The rest is written by the next send to any actor, and by
``receive`` whenever the socket has room, in the same ``select`` that reads the replies.
Calls to one actor keep their order, and a reply is read whenever it arrives.

Before this, steps whose data was over 256 KiB went as Ray tasks.  On the wide bench's
1 MiB batches, a Ray task cost the controller 12.3 ms of CPU a step against 3.9 ms over
the channel, and Ray's raylet 9.4 ms against 2.5 (docs/profiling.md).
"""

from __future__ import annotations

import collections
import select
import socket
import time
from typing import Any, NamedTuple, Optional

from actors.channel import (FAILED, REFUSED, ChannelAuthError, ChannelClosed, FrameReader, FrameWriter, connect,
                            decode, encode, new_key)

__all__ = ["Call", "Channels"]

_CONNECT_TIMEOUT_S = 30.0


class Call(NamedTuple):
    """One call sent over actor ``actor``'s channel; replies come back in ``seq`` order."""

    actor: int
    seq: int


class Channels:
    """One connected socket per actor; calls go out in order and their replies are kept
    until asked for, like Ray futures."""

    def __init__(self, addresses: list[tuple[str, int]], key: bytes) -> None:
        self._socks: list[Optional[socket.socket]] = []
        self._writers: list[FrameWriter] = []  # each connection's frames, tagged (Note [step channel])
        self._readers: list[FrameReader] = []
        self._addresses = [f"{host}:{port}" for host, port in addresses]
        try:
            for actor, (host, port) in enumerate(addresses):
                try:
                    sock, writer, reader = connect((host, port), key, _CONNECT_TIMEOUT_S)
                except ChannelAuthError as e:
                    raise self._auth_failed(actor, e) from None
                self._socks.append(sock)
                self._writers.append(writer)
                self._readers.append(reader)
        except BaseException:
            self.close()
            raise
        n = len(self._socks)
        self._sent, self._read = [0] * n, [0] * n
        self._replies: list[dict[int, tuple]] = [{} for _ in range(n)]
        self._dead: list[Optional[BaseException]] = [None] * n
        self._out: list[collections.deque] = [collections.deque() for _ in range(n)]  # Note [channel outbox]

    @staticmethod
    def new_key() -> bytes:
        """A pipeline's key for its channels, handed to the actors over Ray (Note [step channel])."""
        return new_key()

    def send(self, actor: int, method: str, args: tuple) -> Call:
        """Call ``method(*args)`` on ``actor``; raises here, sending nothing, if ``args`` do not pickle."""
        return self.send_built(actor, self.encode(actor, method, args))

    @staticmethod
    def message(method: str, args: tuple) -> bytes:
        """A call as bytes, built once for ``send_built`` to many actors."""
        return encode((method, args), f"the call {method!r}")

    @staticmethod
    def encode(actor: int, method: str, args: tuple) -> bytes:
        """A call to one actor as bytes for ``send_built`` (raises if it cannot be sent)."""
        return encode((method, args), f"the call {method!r} to actor {actor}")

    def send_built(self, actor: int, message: bytes) -> Call:
        """Send a call built by ``message`` or ``encode``: a step's payload-free actors all get the same
        bytes; only each connection's header and tag are made per actor (Note [step channel])."""
        call = Call(actor, self._sent[actor])
        self._sent[actor] += 1
        if self._dead[actor] is None:
            self._out[actor].extend(memoryview(p) for p in self._writers[actor].parts(message))
        else:  # the channel is gone: the call fails at once, never waits
            self._mark_dead(actor, self._dead[actor])
        for a, out in enumerate(self._out):  # an earlier call's tail to another actor goes on too
            if out:
                self._flush(a)
        return call

    def _flush(self, actor: int) -> None:
        """Write as much of the actor's outbox as its socket takes now (Note [channel outbox])."""
        out, sock = self._out[actor], self._socks[actor]
        try:
            while out:
                sent = sock.send(out[0], socket.MSG_DONTWAIT)
                if sent < len(out[0]):
                    out[0] = out[0][sent:]
                    return
                out.popleft()
        except BlockingIOError:
            return
        except OSError as e:
            self._mark_dead(actor, e)

    def pending_bytes(self) -> int:
        """Bytes of calls not yet written to the sockets (Note [channel outbox])."""
        return sum(len(part) for out in self._out for part in out)

    def done(self, call: Call) -> bool:
        return call.seq in self._replies[call.actor]

    def outstanding(self) -> list[Call]:
        return [Call(a, s) for a in range(len(self._socks)) for s in range(self._read[a], self._sent[a])]

    def receive(self, calls: list[Call], timeout: Optional[float]) -> list[Call]:
        """Read replies until one of ``calls`` is done or ``timeout`` passes; those done.
        Meanwhile every actor's outbox is written as its socket takes it (Note [channel outbox])."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [c for c in calls if self.done(c)]
            if done:
                return done
            waiting = {self._socks[c.actor]: c.actor for c in calls}
            writing = {self._socks[a]: a for a, out in enumerate(self._out) if out}
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, writable, _ = select.select(list(waiting), list(writing), [], remaining)
            for sock in writable:
                self._flush(writing[sock])
            for sock in readable:
                if self._socks[waiting[sock]] is sock:  # not closed by a failed write just now
                    self._read_one(waiting[sock])
            if not readable and not writable:
                return []  # timed out
            if deadline is not None and time.monotonic() >= deadline:
                return [c for c in calls if self.done(c)]

    def _read_one(self, actor: int) -> None:
        try:
            payload = self._readers[actor].read(self._socks[actor])
        except ChannelAuthError as e:
            self._mark_dead(actor, self._auth_failed(actor, e))
            return
        except (ChannelClosed, OSError) as e:
            self._mark_dead(actor, e)
            return
        try:
            reply = decode(payload)
        except Exception as e:  # noqa: BLE001 - authenticated, so the stream is whole: only this call fails
            reply = (FAILED, RuntimeError(f"the controller could not decode the reply of actor {actor} "
                                          f"({type(e).__name__}: {e})"))
        if reply[0] == REFUSED:  # the actor found a frame from here forged or altered, and closed
            self._mark_dead(actor, self._auth_failed(actor, reply[1]))
            return
        self._replies[actor][self._read[actor]] = reply
        self._read[actor] += 1

    def _auth_failed(self, actor: int, reason) -> ChannelAuthError:
        return ChannelAuthError(f"authentication failed on the step channel to actor {actor} "
                                f"({self._addresses[actor]}): {reason}; the connection was closed")

    def _mark_dead(self, actor: int, error: BaseException) -> None:
        if isinstance(error, ChannelClosed):
            closed = error
        else:  # a reset or a broken pipe: the peer went away as surely as with a clean close
            closed = ChannelClosed(f"the step channel to actor {actor} closed: {error}")
        self._dead[actor] = closed
        self._out[actor].clear()
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
