"""Simulated actors: step-channel endpoints without Ray or torch work, many to a process.

Note [simulated actors]
~~~~~~~~~~~~~~~~~~~~~~~
What the controller spends per actor and step on the step channels (Note [step channel] in
actors/channel.py) is measured against thousands of actors, more than one machine runs as
Ray actors.  A simulated actor is only the far end of one channel: a listening socket on
127.0.0.1, the real handshake (``actors.channel.accept``), then for every authenticated
call ``(method, args)`` the answer a ``StageWorker`` gives to ``run_call`` at the end of a
step, ``(OK, tuple(StepReply(losses, [])))``, tagged by the connection's ``FrameWriter``.
The actors of the last pipeline rank answer one loss per microbatch (``sim_losses``, a
function of actor, step and microbatch, so that a reply routed to the wrong actor or step
is seen), the others none.  A few helper processes (``spawn``, ``SimHelpers``, started once
since each imports torch) serve them all, each with one ``selectors`` loop; ``open`` gives a
group of actors on them (``SimActors``).  Nothing runs between a call and its reply, so the
controller's side is all there is to measure (``python -m mpmd bench controller``).

``die_at={actor: step}``: that actor closes its socket when the call of ``step`` arrives,
without answering, as a process that dies mid-step does.

``SimActors.handles`` stand in for the Ray actor handles a ``Dispatcher`` takes: over the
channels it only counts them.  Anything that would reach Ray through one (the dispatcher's
liveness poll, ``_heartbeat``, after a step has been out for 2 s) raises, saying so.
"""

from __future__ import annotations

import multiprocessing
import resource
import selectors
import socket
from typing import Callable, Optional

__all__ = ["SimHelpers", "SimActors", "SimHandle", "sim_losses", "losses_per_actor", "raise_nofile",
           "nofile_hard_limit"]

_START_TIMEOUT_S = 120.0  # a helper's spawn imports actors/ (and so torch): seconds on a busy machine
_FD_SLACK = 256  # descriptors a process holds besides the channels (imports, pipes, Ray's)


def sim_losses(actor: int, step: int, n: int) -> list[float]:
    """The losses simulated actor ``actor`` answers for ``step``: ``n`` floats, each exact,
    naming actor, step and microbatch (so a reply routed wrong does not compare equal)."""
    return [float((step * 2 ** 20 + actor) * 2 ** 10 + j) for j in range(n)]


def losses_per_actor(grid, schedule, num_microbatches: int) -> list[int]:
    """Losses each actor of ``grid`` answers per step: one per microbatch on the actors of the
    rank holding the last stage, none elsewhere (as ``StageWorker`` does)."""
    last = schedule.stage_to_rank[-1]
    return [num_microbatches if grid.rank_of(i) == last else 0 for i in range(grid.size)]


def nofile_hard_limit() -> int:
    """This process's hard limit on open descriptors (a large number when unlimited)."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return 1 << 30 if hard == resource.RLIM_INFINITY else hard


def raise_nofile(need: int, what: str) -> None:
    """Raise this process's soft RLIMIT_NOFILE to ``need`` descriptors (never lowers it); raises
    ``OSError`` naming ``what`` when the hard limit is lower."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise OSError(f"{what} needs {need:,} open descriptors but the hard limit (ulimit -Hn) is {hard:,}; "
                      f"raise it (e.g. in /etc/security/limits.conf, or `ulimit -Hn {need}` as root) or ask for "
                      f"fewer actors")
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


class SimHandle:
    """Stands in for actor ``index``'s Ray handle in a ``Dispatcher`` (Note [simulated actors])."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise RuntimeError(f"simulated actor {self.index} has no Ray handle, yet the controller asked for its "
                           f"{name!r}: something on the step-channel path went to Ray (the Dispatcher's liveness "
                           f"poll, _heartbeat, runs once a step has been out for 2 s); simulated actors only "
                           f"answer over their channel (Note [simulated actors] in benchmarks/sim_actors.py)")

    def __repr__(self) -> str:
        return f"SimHandle({self.index})"


class SimHelpers:
    """``processes`` helper processes (``spawn``) that serve simulated actors, started once:
    each spawn imports ``actors`` (and so torch), seconds on a busy machine.  ``open`` gives a
    group of actors on them; ``close()`` (or leaving the ``with`` block) stops the helpers."""

    def __init__(self, processes: int = 1) -> None:
        if not isinstance(processes, int) or processes < 1:
            raise ValueError(f"processes must be a positive integer, got {processes!r}")
        ctx = multiprocessing.get_context("spawn")
        self._procs: list = []
        self._pipes: list = []
        self._groups = 0
        try:
            for p in range(processes):
                here, there = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(there,), daemon=True, name=f"mpmd-sim-actors-{p}")
                proc.start()
                there.close()
                self._procs.append(proc)
                self._pipes.append(here)
            for p in range(processes):
                self._answer(p, "started")
        except BaseException:
            self.close()
            raise

    @property
    def processes(self) -> int:
        return len(self._procs)

    def open(self, losses: list[int], key: bytes, *, die_at: Optional[dict[int, int]] = None) -> "SimActors":
        """Actors ``0 .. len(losses) - 1``, listening; actor ``i`` answers ``losses[i]`` losses a step
        and (``die_at``) closes its socket, unanswered, when the call of step ``die_at[i]`` comes."""
        if not losses:
            raise ValueError("SimHelpers.open needs at least one actor")
        die_at = die_at or {}
        group, self._groups = self._groups, self._groups + 1
        mine = [list(range(len(losses)))[p::self.processes] for p in range(self.processes)]
        for p, actors in enumerate(mine):  # every helper makes its listeners at once
            if actors:
                self._pipes[p].send(("open", group, key, [(i, losses[i], die_at.get(i)) for i in actors]))
        ports: dict[int, int] = {}
        errors = []
        for p, actors in enumerate(mine):
            if actors:
                try:
                    ports.update(self._answer(p, "ready"))
                except RuntimeError as e:
                    errors.append(e)
        if errors:
            self._close_group(group)
            raise errors[0]
        return SimActors([("127.0.0.1", ports[i]) for i in range(len(losses))], lambda: self._close_group(group))

    def _answer(self, p: int, expect: str):
        proc, pipe = self._procs[p], self._pipes[p]
        if not pipe.poll(_START_TIMEOUT_S):
            raise RuntimeError(f"the simulated-actor process {proc.name} did not answer within "
                               f"{_START_TIMEOUT_S:.0f}s (is the machine overloaded?)")
        try:
            status, value = pipe.recv()
        except EOFError:
            proc.join(5.0)
            raise RuntimeError(f"the simulated-actor process {proc.name} exited (code {proc.exitcode}); "
                               f"its traceback is above") from None
        if status != expect:
            raise RuntimeError(f"the simulated-actor process {proc.name} failed: {value}")
        return value

    def _close_group(self, group: int) -> None:
        """Close a group's sockets in every helper, and wait until they are closed."""
        for p in range(self.processes):
            self._pipes[p].send(("close", group))
        for p in range(self.processes):
            self._answer(p, "closed")

    def close(self) -> None:
        for pipe in self._pipes:
            try:
                pipe.send(("stop",))
            except OSError:
                pass  # already gone
        for proc in self._procs:
            proc.join(5.0)
            if proc.is_alive():
                proc.terminate()
                proc.join(5.0)
        for pipe in self._pipes:
            pipe.close()
        self._procs, self._pipes = [], []

    def __enter__(self) -> "SimHelpers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SimActors:
    """One group of simulated actors (``SimHelpers.open``): ``addresses`` for ``Channels``,
    ``handles`` for a ``Dispatcher``; ``close()`` (or leaving the ``with`` block) closes their
    sockets."""

    def __init__(self, addresses: list[tuple[str, int]], close: Callable[[], None]) -> None:
        self._close = close  # closes this group's sockets in the helpers, and waits for it
        self.addresses = addresses
        self.handles = [SimHandle(i) for i in range(len(addresses))]
        self._open = True

    def close(self) -> None:
        if self._open:
            self._open = False
            self._close()

    def __enter__(self) -> "SimActors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Endpoint:
    """One simulated actor's end of its channel, once the controller has connected."""

    def __init__(self, actor: int, n_losses: int, die_at: Optional[int], conn, writer, reader) -> None:
        self.actor, self.n_losses, self.die_at = actor, n_losses, die_at
        self.conn, self.writer, self.reader = conn, writer, reader

    def serve_one(self) -> bool:
        """Read one call and answer it; False when the channel is over (closed either end)."""
        from actors.channel import ChannelClosed

        try:
            payload = self.reader.read(self.conn)
        except (ChannelClosed, OSError):  # the controller closed (auth failures included: it is not ours to serve)
            return False
        reply = self._reply(payload)
        if reply is None:  # die_at: gone mid-step, no answer
            return False
        try:
            self.writer.write(self.conn, reply)
        except OSError:
            return False
        return True

    def _reply(self, payload) -> Optional[bytes]:
        from actors.channel import FAILED, OK, decode, encode
        from actors.protocol import StepCall, StepReply

        try:
            method, args = decode(payload)
            if method != "run_call":
                raise RuntimeError(f"simulated actor {self.actor} only answers run_call, got {method!r}")
            call = StepCall._make(args[0])
        except Exception as e:  # noqa: BLE001 - the controller raises it, as from a StageWorker
            return encode((FAILED, RuntimeError(f"simulated actor {self.actor}: {type(e).__name__}: {e}")), "failure")
        if call.step == self.die_at:
            return None
        reply = StepReply(losses=sim_losses(self.actor, call.step, self.n_losses), timeline=[])
        return encode((OK, tuple(reply)), f"simulated actor {self.actor}'s reply")


def _serve(control) -> None:
    """A helper process: one selectors loop over the control pipe, every group's listeners and
    its actors' connections, until told to stop (or the pipe closes)."""
    from actors.channel import ChannelClosed, accept

    sel = selectors.DefaultSelector()
    sel.register(control, selectors.EVENT_READ, None)
    groups: dict[int, tuple[bytes, set]] = {}  # group -> (key, its open sockets)
    control.send(("started", None))
    while True:
        for event, _ in sel.select():
            if event.data is None:  # the parent
                try:
                    message = control.recv()
                except EOFError:
                    return
                if message[0] == "stop":
                    return
                if message[0] == "open":
                    control.send(_open_group(sel, groups, *message[1:]))
                else:  # close
                    _, group = message
                    for sock in groups.pop(group, (None, ()))[1]:
                        sel.unregister(sock)
                        sock.close()
                    control.send(("closed", None))
                continue
            kind, group, item = event.data
            if group not in groups:  # closed by the parent since this select began
                continue
            sock = event.fileobj
            key, socks = groups[group]
            if kind == "listen":
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    continue
                try:
                    writer, reader = accept(conn, key)
                except (ChannelClosed, OSError):
                    conn.close()  # not the controller: keep listening
                    continue
                sel.unregister(sock)
                socks.discard(sock)
                sock.close()  # one connection per actor, as ChannelServer
                sel.register(conn, selectors.EVENT_READ, ("conn", group, _Endpoint(*item, conn, writer, reader)))
                socks.add(conn)
            elif not item.serve_one():
                sel.unregister(sock)
                socks.discard(sock)
                sock.close()


def _open_group(sel, groups: dict, group: int, key: bytes, endpoints: list) -> tuple:
    """Listeners for a group's actors, registered: ``("ready", {actor: port})``, or ``("error", why)``."""
    listeners = []
    try:
        held = sum(len(socks) for _, socks in groups.values())
        raise_nofile(held + len(endpoints) + _FD_SLACK,
                     f"a simulated-actor process serving {held + len(endpoints):,} actors")
        for actor, n_losses, die_at in endpoints:
            sock = socket.create_server(("127.0.0.1", 0), backlog=4)
            sock.setblocking(False)
            listeners.append((sock, (actor, n_losses, die_at)))
    except BaseException as e:  # noqa: BLE001 - said to the parent, which raises it
        for sock, _ in listeners:
            sock.close()
        return ("error", f"{type(e).__name__}: {e}")
    groups[group] = (key, {sock for sock, _ in listeners})
    for sock, spec in listeners:
        sel.register(sock, selectors.EVENT_READ, ("listen", group, spec))
    return ("ready", {spec[0]: sock.getsockname()[1] for sock, spec in listeners})
