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
The actor listens on loopback when the controller is on its node, on its node's
address otherwise.

Failure: a dead actor closes its end of the socket, which the controller sees at
once (a process the actor forked closes its copy of the socket at once, so it cannot keep
a dead actor's channel open); a silent node is found by TCP keep-alive (Note [channels at
scale] in mpmd/runtime/channels.py); a hung actor by the step timeout or by a peer's
communication timeout, as before.  A call that does not decode in the actor, or whose reply does not
pickle, comes back as a failed reply and the channel goes on serving.

Authentication.  A frame is unpickled, so whoever can write one to the socket could
run code in the actor, or through a reply in the controller.  Every frame is therefore
authenticated before anything is unpickled:

- The controller makes a random 32-byte key per pipeline (``new_key``) and hands it to
  each actor over Ray (``open_channel``), the one channel trusted here.  The key never
  goes on the socket.
- At accept the actor sends a fresh 16-byte nonce; the controller answers with its own
  nonce and an HMAC of both under the key; the actor checks it (a peer without the key
  is closed and the actor accepts again) and answers with its own HMAC, which the
  controller checks.  Each direction then has a key of its own derived from the
  pipeline's key and both nonces (``_derive``): frames recorded on another connection,
  or reflected back the other way, fail.
- A frame is ``length (!Q) | tag (32 bytes) | payload``; the tag is HMAC-SHA256 under
  the direction's key of ``sequence (!Q) | length (!Q) | payload``, the sequence
  counting that direction's frames from 0 on both ends (it is never sent), so a frame
  replayed, dropped or reordered fails as well.  The reader checks the length against
  ``MAX_FRAME_BYTES`` before allocating, and the tag with ``hmac.compare_digest``
  before unpickling.
- A failed check closes the connection as a protocol violation, never a dead actor:
  the actor first writes a ``REFUSED`` reply (authenticated, in its direction), and
  the controller raises ``ChannelAuthError`` ("authentication failed on the step
  channel to actor N"), which the dispatcher reports as such.

Frames are authenticated, not encrypted: whoever sees the traffic sees the batches and
the replies (on one node it stays on loopback).

Cost: the tag takes about 2 us per small frame at each end (a step's 56-byte bare call,
Note [bare calls] in mpmd/runtime/dispatch.py), and 0.7 ms per MiB of payload at each end
(SHA-256 at about 1.4 GB/s with the CPU's SHA instructions).  A call pickled once for many
actors stays one shared payload: only its 40-byte header, with that connection's tag,
is made per actor; a large payload is never joined to its header (the tag is computed
over the parts, which are written as they are), and the reader hashes it as it arrives.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import pickle
import secrets
import socket
import struct
import threading
import traceback
import weakref
from typing import Any, Callable, Optional

try:
    from _hashlib import hmac_new as _openssl_hmac  # CPython's OpenSSL HMAC (what hmac.new wraps)
except ImportError:  # a Python built without OpenSSL
    _openssl_hmac = None

__all__ = ["ChannelServer", "FrameReader", "FrameWriter", "connect", "accept", "encode", "decode", "new_key",
           "ChannelClosed", "ChannelAuthError", "MAX_FRAME_BYTES", "FRAME_HEADER_BYTES", "OK", "FAILED", "REFUSED"]

# The largest payload a frame may carry.  A step's batch is a few MiB; a call or reply
# near 1 GiB already costs seconds to pickle and hash and twice its size in memory at each
# end, and is what Ray's object store is for (``step_channel=False``).  A reader checks a
# header against it before allocating the payload's buffer.
MAX_FRAME_BYTES = 1 << 30

OK, FAILED, REFUSED = 0, 1, 2  # a reply's status; REFUSED: the actor rejected a frame and closes
_HEADER = struct.Struct("!Q32s")  # payload length, HMAC-SHA256 tag
FRAME_HEADER_BYTES = _HEADER.size
_TAGGED = struct.Struct("!QQ")  # what the tag covers before the payload: sequence number, payload length
_NONCE = 16
_TAG = 32
_SMALL = 65536  # below: header and payload in one write (one segment with TCP_NODELAY)
_LABEL = b"mpmd step channel v1 "
_ACCEPT_TIMEOUT_S = 60.0
_HANDSHAKE_TIMEOUT_S = 10.0


class ChannelClosed(ConnectionError):
    """The other end of a step channel went away."""


class ChannelAuthError(ChannelClosed):
    """A handshake or frame on a step channel failed authentication (its tag, its sequence
    number or its length), and the connection was closed: something other than the other
    end wrote to it.  The peer did not die."""


def new_key() -> bytes:
    """A pipeline's channel key: random, handed to the actors over Ray."""
    return secrets.token_bytes(32)


def _keyed(key: bytes):
    """An HMAC-SHA256 keyed with ``key``, to copy per frame: OpenSSL's object itself where
    there is one (its copy, update and digest run in C; ``hmac.HMAC`` wraps each in Python)."""
    if _openssl_hmac is not None:
        try:
            return _openssl_hmac(key, digestmod="sha256")
        except (ValueError, TypeError):  # an OpenSSL without it: the portable object
            pass
    return hmac.new(key, digestmod=hashlib.sha256)


def encode(obj: Any, what: str) -> bytes:
    """``obj`` pickled as one frame's payload; ``what`` names it in the error if it cannot be."""
    try:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises, said with what failed
        raise TypeError(f"{what} cannot go over the step channel: it does not pickle ({type(e).__name__}: {e}); "
                        f"only values that pickle (tensors, numbers, containers of them) can travel") from e
    if len(data) > MAX_FRAME_BYTES:
        raise ValueError(f"{what} is {len(data):,} bytes pickled, over the step channel's limit of "
                         f"{MAX_FRAME_BYTES:,} (MAX_FRAME_BYTES in actors/channel.py); send less per step, or "
                         f"set step_channel=False so that Ray's object store carries it")
    return data


def decode(payload: bytearray) -> Any:
    """An authenticated frame's payload (``FrameReader.read``) as the object sent."""
    return pickle.loads(payload)


class FrameWriter:
    """One direction's outgoing frames: each is tagged with the next sequence number."""

    def __init__(self, key: bytes) -> None:
        self._mac = _keyed(key)  # keyed once; copied per frame
        self._seq = 0

    def parts(self, payload: bytes) -> tuple:
        """The bytes to write for ``payload`` (from ``encode``): one part, or header and
        payload apart when large, so the payload (shared by many actors) is not copied."""
        n = len(payload)
        assert n <= MAX_FRAME_BYTES, n  # encode refuses larger payloads
        mac = self._mac.copy()
        mac.update(_TAGGED.pack(self._seq, n))
        mac.update(payload)
        self._seq += 1
        head = _HEADER.pack(n, mac.digest())
        return (head + payload,) if n < _SMALL else (head, payload)

    def write(self, sock: socket.socket, payload: bytes) -> None:
        for part in self.parts(payload):
            sock.sendall(part)


class FrameReader:
    """One direction's incoming frames: the next one's payload once its length and tag check."""

    def __init__(self, key: bytes) -> None:
        self._mac = _keyed(key)
        self._seq = 0

    def read(self, sock: socket.socket) -> bytearray:
        n, tag = _HEADER.unpack(_recv_exactly(sock, _HEADER.size))
        if n > MAX_FRAME_BYTES:  # checked before the buffer is allocated
            raise ChannelAuthError(f"frame {self._seq} claims {n:,} bytes, over the limit of {MAX_FRAME_BYTES:,} "
                                   f"(MAX_FRAME_BYTES): no end of a step channel writes that")
        mac = self._mac.copy()
        mac.update(_TAGGED.pack(self._seq, n))
        payload = _recv_exactly(sock, n, mac)
        if not hmac.compare_digest(mac.digest(), tag):
            raise ChannelAuthError(f"frame {self._seq} ({n:,} bytes) failed its HMAC check: it was not written by "
                                   f"the other end of this connection, or was altered, replayed or reordered")
        self._seq += 1
        return payload

    def take(self, buffer: bytearray) -> tuple[list[bytes], Optional[ChannelAuthError]]:
        """The payloads of the whole frames at the start of ``buffer`` (bytes read as they came,
        ``Channels``' way of reading many sockets without blocking on any), each checked as
        ``read`` checks it, and the error of the first that fails (the frames after it are not
        looked at); the bytes taken are removed from ``buffer``, a partial frame stays."""
        payloads, view, at, end = [], memoryview(buffer), 0, len(buffer)
        error = None
        try:
            while end - at >= _HEADER.size:
                n, tag = _HEADER.unpack_from(buffer, at)
                if n > MAX_FRAME_BYTES:
                    error = ChannelAuthError(f"frame {self._seq} claims {n:,} bytes, over the limit of "
                                             f"{MAX_FRAME_BYTES:,} (MAX_FRAME_BYTES): no end of a step channel "
                                             f"writes that")
                    break
                if end - at - _HEADER.size < n:
                    break
                with view[at + _HEADER.size:at + _HEADER.size + n] as payload:
                    mac = self._mac.copy()
                    mac.update(_TAGGED.pack(self._seq, n))
                    mac.update(payload)
                    if not hmac.compare_digest(mac.digest(), tag):
                        error = ChannelAuthError(f"frame {self._seq} ({n:,} bytes) failed its HMAC check: it was "
                                                 f"not written by the other end of this connection, or was altered, "
                                                 f"replayed or reordered")
                        break
                    payloads.append(bytes(payload))
                self._seq += 1
                at += _HEADER.size + n
        finally:
            view.release()
        if at:
            del buffer[:at]
        return payloads, error


def _derive(key: bytes, label: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return hmac.digest(key, _LABEL + label + server_nonce + client_nonce, "sha256")


def connect(address: tuple[str, int], key: bytes, timeout_s: float) -> tuple[socket.socket, FrameWriter, FrameReader]:
    """The controller's end: connect to a ``ChannelServer`` and run the handshake (Note
    [step channel]).  Raises ``ChannelAuthError`` if the peer does not prove it holds ``key``."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        server_nonce = bytes(_recv_exactly(sock, _NONCE))
        client_nonce = secrets.token_bytes(_NONCE)
        sock.sendall(client_nonce + _derive(key, b"controller", server_nonce, client_nonce))
        try:
            proof = bytes(_recv_exactly(sock, _TAG))
        except ChannelClosed:
            raise ChannelClosed(f"the peer at {address[0]}:{address[1]} closed the step channel during the "
                                f"handshake: it refused this controller's proof of the key, or it died") from None
        if not hmac.compare_digest(proof, _derive(key, b"actor", server_nonce, client_nonce)):
            raise ChannelAuthError("the peer did not prove it holds the pipeline's key")
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return (sock, FrameWriter(_derive(key, b"to actor", server_nonce, client_nonce)),
                FrameReader(_derive(key, b"to controller", server_nonce, client_nonce)))
    except BaseException:
        sock.close()
        raise


def accept(conn: socket.socket, key: bytes) -> tuple[FrameWriter, FrameReader]:
    """The actor's end of the handshake on an accepted connection (Note [step channel]).
    Raises ``ChannelAuthError`` if the peer does not prove it holds ``key``."""
    conn.settimeout(_HANDSHAKE_TIMEOUT_S)
    server_nonce = secrets.token_bytes(_NONCE)
    conn.sendall(server_nonce)
    got = bytes(_recv_exactly(conn, _NONCE + _TAG))
    client_nonce, proof = got[:_NONCE], got[_NONCE:]
    if not hmac.compare_digest(proof, _derive(key, b"controller", server_nonce, client_nonce)):
        raise ChannelAuthError("the peer did not prove it holds the pipeline's key")
    conn.sendall(_derive(key, b"actor", server_nonce, client_nonce))
    conn.settimeout(None)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return (FrameWriter(_derive(key, b"to controller", server_nonce, client_nonce)),
            FrameReader(_derive(key, b"to actor", server_nonce, client_nonce)))


def _recv_exactly(sock: socket.socket, n: int, mac=None) -> bytearray:
    """``n`` bytes from ``sock``; ``mac`` (if given) is updated with each piece as it arrives,
    so that a large payload is hashed while the rest is still on its way."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ChannelClosed("the step channel was closed by its peer")
        if mac is not None:
            mac.update(view[got:got + k])
        got += k
    return buf


_SERVERS: "weakref.WeakSet[ChannelServer]" = weakref.WeakSet()  # this process's, for _close_after_fork


def _close_after_fork() -> None:
    """In a child the actor forked (a DataLoader worker, a subprocess): close its copies of the
    channel's sockets, so the controller sees the actor's death when the actor dies."""
    for server in list(_SERVERS):
        server.close_copies()


os.register_at_fork(after_in_child=_close_after_fork)


class ChannelServer:
    """The actor's end: listens on ``host``, serves one authenticated connection in a
    daemon thread (Note [step channel])."""

    def __init__(self, call: Callable[[str, tuple], Any], host: str, key: bytes) -> None:
        self._call, self._key = call, key
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_TIMEOUT_S)
        self._conn: Optional[socket.socket] = None  # the controller's connection, once accepted
        self.address = (host, self._listener.getsockname()[1])
        _SERVERS.add(self)
        self._thread = threading.Thread(target=self._serve, name="mpmd-step-channel", daemon=True)
        self._thread.start()

    def close_copies(self) -> None:
        """Close this process's descriptors of the channel (a forked child's, Note [step channel])."""
        for sock in (self._listener, self._conn):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass

    def _serve(self) -> None:
        try:
            accepted = self._accept()
        finally:
            self._listener.close()
        if accepted is None:
            return
        conn, writer, reader = accepted
        self._conn = conn
        with conn:
            while True:
                try:
                    payload = reader.read(conn)
                except ChannelAuthError as e:  # a protocol violation: say so (authenticated), then close
                    try:
                        writer.write(conn, encode((REFUSED, f"the actor refused a frame from the controller: {e}"),
                                                  "the refusal"))
                    except OSError:
                        pass
                    return
                except (ChannelClosed, OSError):
                    return  # the controller closed the channel (shutdown) or went away
                try:
                    writer.write(conn, self._reply(payload))
                except OSError:
                    return

    def _reply(self, payload: bytearray) -> bytes:
        """The encoded reply to one authenticated call: its result, or what failed (decoding
        the call, running it, or pickling the result), as a FAILED reply."""
        try:
            method, args = decode(payload)
        except Exception as e:  # noqa: BLE001 - e.g. a class this process cannot import
            return encode((FAILED, RuntimeError(f"the actor could not decode a call from the step channel "
                                                f"({type(e).__name__}: {e})")), "the failure")
        try:
            result = (OK, self._call(method, args))
        except BaseException as e:  # noqa: BLE001 - the controller raises it
            result = (FAILED, _picklable(e))
        try:
            return encode(result, f"the reply to {method!r}")
        except (TypeError, ValueError) as e:
            return encode((FAILED, RuntimeError(str(e))), "the failure")

    def _accept(self) -> Optional[tuple[socket.socket, FrameWriter, FrameReader]]:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # timed out: nobody came (the controller failed during set-up)
                return None
            try:
                return (conn, *accept(conn, self._key))
            except (ChannelClosed, OSError):
                conn.close()  # not the controller (ChannelAuthError included): wait for it

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
