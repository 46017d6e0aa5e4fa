"""TCP ports: a free one, the one helper every launcher, test host, stand-in and benchmark needs, and
SDP_PORT_RANGE, the range every listener of a job takes its port from when a firewall opens only a
range. A leaf of the package (no package __init__ of ours runs before it), so test infrastructure can
use it too."""
from __future__ import annotations

import os
import random
import socket

PORT_RANGE = "SDP_PORT_RANGE"


def port_range(environ=None) -> tuple[int, int] | None:
    """SDP_PORT_RANGE as (lo, hi), both included; None when unset or empty (any free port)."""
    value = ((os.environ if environ is None else environ).get(PORT_RANGE) or "").strip()
    if not value:
        return None
    lo, sep, hi = value.partition("-")
    try:
        lo_n, hi_n = int(lo, 10), int(hi, 10)
    except ValueError:
        lo_n = hi_n = 0
    if not sep or not 1 <= lo_n <= hi_n <= 65535:
        raise ValueError(f"{PORT_RANGE}={value!r} is not a port range: use LO-HI, e.g. 29400-29499 "
                         f"(1 <= LO <= HI <= 65535)")
    return lo_n, hi_n


def free_port(host: str = "127.0.0.1", ports: str | None = None) -> int:
    """A TCP port free on `host` now (the usual race: another process may take it before we bind),
    inside the range `ports` ("LO-HI", a job's SDP_PORT_RANGE), else inside this process's
    SDP_PORT_RANGE when that is set."""
    ports = port_range({PORT_RANGE: ports} if ports else None)
    if ports is None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    lo, hi = ports
    candidates = list(range(lo, hi + 1))
    random.shuffle(candidates)  # two launchers on one host do not race for the same first port
    for port in candidates:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    raise OSError(f"no port of {PORT_RANGE}={lo}-{hi} is free on {host}: widen the range")
