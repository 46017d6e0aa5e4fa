"""A free TCP port, the one helper every launcher, test host, stand-in and benchmark needs. A leaf of
the package (no package __init__ of ours runs before it), so test infrastructure can use it too."""
from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now (the usual race: another process may take it before we bind)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
