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
once (``MSG_DONTWAIT``).  The rest is written whenever the socket has room: the socket is
then watched for writing too, in the same wait that reads the replies (``poll``).  Calls to
one actor keep their order, and a reply is read whenever it arrives.

Before this, steps whose data was over 256 KiB went as Ray tasks.  On the wide bench's
1 MiB batches, a Ray task cost the controller 12.3 ms of CPU a step against 3.9 ms over
the channel, and Ray's raylet 9.4 ms against 2.5 (docs/profiling.md).

Note [channels at scale]
~~~~~~~~~~~~~~~~~~~~~~~~
One controller serves thousands of actors, so nothing here may cost more than what is
ready.  The sockets are registered once with the operating system's readiness API
(``selectors``: epoll on Linux, no descriptor ceiling, unlike ``select``'s 1,023); a send
writes to its one actor; a wait (``poll``) handles only the sockets that are ready and
answers which calls completed in it, so the dispatcher's wait for a step costs one look
per reply, not one scan of every actor per wake-up.  Where the process's soft descriptor
limit is too low for the channels, it is raised to what is needed (Ray does that for a
driver it starts; a controller without Ray, the bench, may not have it), and a hard limit
too low is an error that says which limit and how many descriptors are needed.

Liveness needs no polling either: a dead actor's process closes its socket, which wakes the
wait at once; a dead node (or a cable) stops answering TCP, which keep-alive probes and a
limit on unacknowledged data (``TCP_USER_TIMEOUT``) turn into a closed channel within
``LIVENESS_S``; a hung actor that still answers TCP is the step timeout's to find.  (The
actor closes its end of the channel in any process it forks, so a child cannot keep a dead
actor's connection open: ``actors/channel.py``.)
"""

from __future__ import annotations

import collections
import os
import resource
import selectors
import socket
import time
from typing import Any, NamedTuple, Optional

from actors.channel import (FAILED, FRAME_HEADER_BYTES, REFUSED, ChannelAuthError, ChannelClosed, FrameReader,
                            FrameWriter, connect, decode, encode, new_key)

__all__ = ["Call", "Channels", "ensure_descriptors", "LIVENESS_S"]

_CONNECT_TIMEOUT_S = 30.0
# A node that stops answering TCP is found within about this long (Note [channels at scale]):
# keep-alive probes from 10 s of silence, 5 s apart, 3 unanswered; unacknowledged data as long.
LIVENESS_S = 25
_KEEPALIVE = ((socket.SOL_SOCKET, "SO_KEEPALIVE", 1), (socket.IPPROTO_TCP, "TCP_KEEPIDLE", 10),
              (socket.IPPROTO_TCP, "TCP_KEEPINTVL", 5), (socket.IPPROTO_TCP, "TCP_KEEPCNT", 3),
              (socket.IPPROTO_TCP, "TCP_USER_TIMEOUT", LIVENESS_S * 1000))
_SPARE_DESCRIPTORS = 256  # beyond the channels: Ray's, files, pipes
_READ_BYTES = 65536  # what one read of a ready socket asks for, at least
_MAX_READ_BYTES = 64 << 20  # and at most, for a large reply's rest


def ensure_descriptors(sockets: int) -> None:
    """Raise this process's soft limit on open files so that ``sockets`` more fit (Note
    [channels at scale]); a hard limit too low is an ``OSError`` saying what is needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc: assume the spare covers what is open
        in_use = 0
    need = in_use + sockets + _SPARE_DESCRIPTORS
    if need <= soft or soft == resource.RLIM_INFINITY:
        return
    if hard != resource.RLIM_INFINITY and need > hard:
        raise OSError(f"the controller needs {need:,} open files for {sockets:,} step channels ({in_use:,} already "
                      f"open) but its hard limit is {hard:,} (ulimit -Hn); raise it (e.g. LimitNOFILE in systemd, "
                      f"nofile in /etc/security/limits.conf) or run fewer actors per controller")
    room = 2 * need if hard == resource.RLIM_INFINITY else min(hard, 2 * need)  # room to grow, within the hard limit
    resource.setrlimit(resource.RLIMIT_NOFILE, (room, hard))


class Call(NamedTuple):
    """One call sent over actor ``actor``'s channel; replies come back in ``seq`` order."""

    actor: int
    seq: int


class Channels:
    """One connected socket per actor; calls go out in order and their replies are kept
    until asked for, like Ray futures (Note [channels at scale])."""

    def __init__(self, addresses: list[tuple[str, int]], key: bytes) -> None:
        ensure_descriptors(len(addresses))
        self._socks: list[Optional[socket.socket]] = []
        self._writers: list[FrameWriter] = []  # each connection's frames, tagged (Note [step channel])
        self._readers: list[FrameReader] = []
        self._addresses = [f"{host}:{port}" for host, port in addresses]
        self._selector = selectors.DefaultSelector()
        try:
            for actor, (host, port) in enumerate(addresses):
                try:
                    sock, writer, reader = connect((host, port), key, _CONNECT_TIMEOUT_S)
                except ChannelAuthError as e:
                    raise self._auth_failed(actor, e) from None
                _keep_alive(sock)
                self._selector.register(sock, selectors.EVENT_READ, actor)
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
        self._writing: set[int] = set()  # actors whose outbox waits for room: their sockets are watched for it
        self._completed: list[Call] = []  # calls done since the current poll began
        self._inbox: list[bytearray] = [bytearray() for _ in range(n)]  # bytes read, not yet whole frames

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
        bytes; only each connection's header and tag are made per actor (Note [step channel]).  Only
        this actor's socket is written (Note [channels at scale])."""
        call = Call(actor, self._sent[actor])
        self._sent[actor] += 1
        if self._dead[actor] is None:
            self._out[actor].extend(map(memoryview, self._writers[actor].parts(message)))
            if actor not in self._writing:  # else its socket is full: poll writes when it has room
                self._flush(actor)
        else:  # the channel is gone: the call fails at once, never waits
            self._mark_dead(actor, self._dead[actor])
        return call

    def _flush(self, actor: int) -> None:
        """Write as much of the actor's outbox as its socket takes now; watch the socket for room
        while some is left (Note [channel outbox])."""
        out, sock = self._out[actor], self._socks[actor]
        try:
            while out:
                sent = sock.send(out[0], socket.MSG_DONTWAIT)
                if sent < len(out[0]):
                    out[0] = out[0][sent:]
                    break
                out.popleft()
        except BlockingIOError:
            pass
        except OSError as e:
            self._mark_dead(actor, e)
            return
        if out and actor not in self._writing:
            self._writing.add(actor)
            self._selector.modify(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, actor)
        elif not out and actor in self._writing:
            self._writing.discard(actor)
            self._selector.modify(sock, selectors.EVENT_READ, actor)

    def pending_bytes(self) -> int:
        """Bytes of calls not yet written to the sockets (Note [channel outbox])."""
        return sum(len(part) for a in self._writing for part in self._out[a])

    def done(self, call: Call) -> bool:
        return call.seq in self._replies[call.actor]

    def outstanding(self) -> list[Call]:
        return [Call(a, s) for a in range(len(self._socks)) for s in range(self._read[a], self._sent[a])]

    def poll(self, timeout: Optional[float]) -> list[Call]:
        """Wait until a reply arrives (or a channel closes), up to ``timeout`` seconds (None: no
        limit), writing outboxes as their sockets take them; the calls that completed in this
        wait, failed ones included (Note [channels at scale]).  ``[]``: timed out."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._completed = []
        while not self._completed:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            if not self._selector.get_map():
                break  # every channel is closed: nothing will come
            for key, events in self._selector.select(remaining):
                actor = key.data
                if events & selectors.EVENT_WRITE and self._socks[actor] is key.fileobj:
                    self._flush(actor)
                if events & selectors.EVENT_READ and self._socks[actor] is key.fileobj:  # not closed just now
                    self._read_one(actor)
        completed, self._completed = self._completed, []
        return completed

    def receive(self, calls: list[Call], timeout: Optional[float]) -> list[Call]:
        """Read replies until one of ``calls`` is done or ``timeout`` passes; those done.  For a
        few calls (it looks at each once per wake-up); a step's wait uses ``poll``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done = [c for c in calls if self.done(c)]
            remaining = None if deadline is None else deadline - time.monotonic()
            if done or (remaining is not None and remaining <= 0):
                return done
            if not self.poll(remaining) and not self._selector.get_map():
                return []  # every channel is closed and none of these is done

    def _read_one(self, actor: int) -> None:
        """Read what the actor's socket holds (one call, never blocking) and take its whole frames."""
        buffer = self._inbox[actor]
        try:
            data = self._socks[actor].recv(max(_READ_BYTES, self._wanted(buffer)), socket.MSG_DONTWAIT)
            if not data:
                raise ChannelClosed("the step channel was closed by its peer")
            buffer += data
        except BlockingIOError:
            return
        except (ChannelClosed, OSError) as e:
            self._mark_dead(actor, e)
            return
        payloads, forged = self._readers[actor].take(buffer)
        for payload in payloads:
            try:
                reply = decode(payload)
            except Exception as e:  # noqa: BLE001 - authenticated, so the stream is whole: only this call fails
                reply = (FAILED, RuntimeError(f"the controller could not decode the reply of actor {actor} "
                                              f"({type(e).__name__}: {e})"))
            if reply[0] == REFUSED:  # the actor found a frame from here forged or altered, and closed
                self._mark_dead(actor, self._auth_failed(actor, reply[1]))
                return
            seq = self._read[actor]
            self._replies[actor][seq] = reply
            self._read[actor] = seq + 1
            self._completed.append(Call(actor, seq))
        if forged is not None:  # the frames before it were the actor's
            self._mark_dead(actor, self._auth_failed(actor, forged))

    @staticmethod
    def _wanted(buffer: bytearray) -> int:
        """The bytes the frame begun in ``buffer`` still needs (0 if no header yet): a large reply
        is read in few calls."""
        if len(buffer) < FRAME_HEADER_BYTES:
            return 0
        return min(int.from_bytes(buffer[:8], "big") + FRAME_HEADER_BYTES - len(buffer), _MAX_READ_BYTES)

    def _auth_failed(self, actor: int, reason) -> ChannelAuthError:
        return ChannelAuthError(f"authentication failed on the step channel to actor {actor} "
                                f"({self._addresses[actor]}): {reason}; the connection was closed")

    def _mark_dead(self, actor: int, error: BaseException) -> None:
        if isinstance(error, ChannelClosed):
            closed = error
        else:  # a reset, a broken pipe, a peer silent past LIVENESS_S: gone as surely as with a clean close
            closed = ChannelClosed(f"the step channel to actor {actor} closed: {error}")
        self._dead[actor] = closed
        self._out[actor].clear()
        self._writing.discard(actor)
        for seq in range(self._read[actor], self._sent[actor]):
            self._replies[actor][seq] = (FAILED, closed)
            self._completed.append(Call(actor, seq))
        self._read[actor] = self._sent[actor]
        self._close_socket(actor)

    def _close_socket(self, actor: int) -> None:
        sock, self._socks[actor] = self._socks[actor], None
        if sock is not None:
            try:
                self._selector.unregister(sock)
            except (KeyError, ValueError):
                pass
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
        for actor in range(len(self._socks)):
            self._close_socket(actor)
        self._selector.close()


def _keep_alive(sock: socket.socket) -> None:
    """Probe a silent peer and bound unacknowledged data (Note [channels at scale]); options
    this platform lacks are skipped."""
    for level, name, value in _KEEPALIVE:
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(level, option, value)
            except OSError:
                pass
