"""What tests that start their own gloo processes (no Ray) share."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (the processes' rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
