"""One node's agent as the notebook side sees it (a Link), for every remote target: the SSH target's link
is an ssh client's stdin/stdout (launch/targets/ssh/launcher.py), the Ray target's an actor running the agent
(launch/targets/ray/launcher.py), the Slurm target's an srun step (launch/targets/slurm/launcher.py). The run that drives the
links is launch/kernel/agent_run/run.py.
"""
from __future__ import annotations

import collections
import queue
import subprocess
import threading
import time

from sdp_jupyter.launch import channel

CONNECT_TIMEOUT = 10       # seconds for a link to reach its node
CONNECTED = "sdp-agent-connected"  # what a link's command prints on stderr once it reached the node


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


class ProcessLink(Link):
    """A link that is a child process whose stdin and stdout carry the frames (an ssh client, srun, a local
    agent); its stderr lines are kept, and the line CONNECTED sets `connected`."""

    def begin(self, proc: subprocess.Popen) -> None:
        self._send_lock = threading.Lock()
        self.proc = proc
        threading.Thread(target=self._read, daemon=True, name=f"sdp-{self.kind}-{self.host}").start()
        self._err_thread = threading.Thread(target=self._read_stderr, daemon=True,
                                            name=f"sdp-{self.kind}-err-{self.host}")
        self._err_thread.start()

    def _read(self) -> None:
        why = f"the {self.kind} connection closed"
        try:
            while True:
                self.heard(channel.decode(self.proc.stdout))
        except channel.ChannelClosed:
            pass
        except ValueError as e:
            why = f"the agent sent a bad frame ({e})"
        code = self.proc.wait()
        self._err_thread.join(timeout=2)
        self.inbox.put((self.node, {"type": "eof", "why": why, "code": code}))

    def _read_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            if line == CONNECTED and not self.connected.is_set():
                self.connected.set()
            else:
                self.stderr.append(line)

    def send(self, message: dict) -> bool:
        with self._send_lock:
            try:
                self.proc.stdin.write(channel.encode(message))
                self.proc.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def close(self, wait: float = 5.0) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
