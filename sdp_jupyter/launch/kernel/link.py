"""One node's agent as the notebook side sees it (a Link), for every remote target: the SSH target's link
is an ssh client's stdin/stdout (launch/kernel/ssh.py), the Ray target's an actor running the agent
(launch/kernel/ray.py), the Slurm target's an srun step (launch/kernel/slurm.py). The run that drives the
links is launch/kernel/remote.py.
"""
from __future__ import annotations

import collections
import queue
import threading
import time

from sdp_jupyter.launch import channel

CONNECT_TIMEOUT = 10       # seconds for a link to reach its node


def install_fix(version: str, where: str) -> str:
    """The fix for a host that lacks this sdp_jupyter: no package index serves it, so a checkout or a
    wheel built from one (docs/install.md, "On SSH hosts, Ray nodes and Slurm nodes")."""
    return (f"install sdp_jupyter {version} {where} from a checkout (pip install .) or a wheel built with "
            "pip wheel (docs/install.md)")


class Link:
    """One node's agent as the notebook side sees it. Frames go into `inbox` as (node, message); when
    the link ends, (node, {"type": "eof", "why", "code"}). `connected` is set once the node is reached
    (before the interpreter starts); `stderr` keeps the link's and the agent's last words."""

    kind = "link"
    connect_timeout = CONNECT_TIMEOUT  # seconds from opening the link until `connected` must be set

    def __init__(self, node: int, host: str, inbox: queue.Queue):
        self.node, self.host, self.inbox = node, host, inbox
        self.hello: dict | None = None
        self.last_heard = time.monotonic()
        self.stderr = collections.deque(maxlen=40)
        self.connected = threading.Event()

    def heard(self, message: dict) -> None:
        self.last_heard = time.monotonic()
        self.inbox.put((self.node, message))

    def send(self, message: dict) -> bool:
        raise NotImplementedError

    def close(self, wait: float = 5.0) -> None:
        raise NotImplementedError

    def unreachable(self) -> str:
        return f"not reachable within {CONNECT_TIMEOUT} s"

    def diagnose(self, code, python: str) -> str:
        """What went wrong before the agent said hello, and the fix."""
        said = " ".join(line for line in self.stderr if line)[-400:]
        if "No module named" in said and "sdp_jupyter" in said:
            return (f"sdp_jupyter is not installed for {python} there. Fix: "
                    + install_fix(channel.version(), f"for that Python on {self.host}"))
        return f"the agent did not start (exit {code}: {said or 'no output'})"
