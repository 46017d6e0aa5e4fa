"""What runs inside the Ray target's actors, on the Ray nodes (launch/targets/ray/launcher.py starts them).

AgentActor starts the per-host agent (launch/host/agent.py) as its child and relays its frames both ways;
PoolActor holds a node's warm pool server (launch/host/warm.py) for as long as the notebook holds the
actor, and PoolChannel is what the notebook's warm_pool.Pool uses of that actor, as it would use a process.
"""
from __future__ import annotations

import collections
import os
import sys
import threading

from sdp_jupyter.launch import channel


class AgentActor:
    """Runs on a Ray node: starts the agent as its child and relays frames both ways."""

    def __init__(self):
        import subprocess

        import ray

        self.addr = ray.util.get_node_ip_address()
        env = dict(os.environ, SDP_AGENT_ADDR=self.addr)
        self.proc = subprocess.Popen([sys.executable, "-m", "sdp_jupyter.launch.host.agent"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.frames: collections.deque = collections.deque()
        self.stderr: collections.deque = collections.deque(maxlen=40)
        self.ended: int | None = None
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def _read(self) -> None:
        try:
            while True:
                body = channel.read_body(self.proc.stdout)
                with self.cond:
                    self.frames.append(body)
                    self.cond.notify_all()
        except (channel.ChannelClosed, ValueError):
            pass
        code = self.proc.wait()
        with self.cond:
            self.ended = code
            self.cond.notify_all()

    def _read_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            self.stderr.append(raw.decode("utf-8", "replace").rstrip())

    def send(self, data: bytes) -> None:
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def recv(self, wait: float):
        """(frames, exit code of the agent or None, its last stderr lines once it ended)."""
        with self.cond:
            if not self.frames and self.ended is None:
                self.cond.wait(wait)
            frames = list(self.frames)
            self.frames.clear()
            ended = self.ended if not self.frames else None
        return frames, ended, list(self.stderr) if ended is not None else []

    def close(self, wait: float) -> int | None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            return self.proc.wait(timeout=wait)
        except Exception:
            self.proc.kill()
            return self.proc.wait()


class PoolActor:
    """Runs on one Ray node for as long as the notebook holds it: that node's warm pool server
    (launch/host/warm.py) as its child, started from a thread that lives as long as the server (the
    server's parent-death signal is armed against the thread that started it)."""

    def __init__(self, server_args: list):
        import subprocess

        started = threading.Event()

        def own() -> None:
            env = dict(os.environ, OPENBLAS_NUM_THREADS="1")  # OpenBLAS would start its thread pool at import
            try:
                self.proc = subprocess.Popen([sys.executable, "-m", "sdp_jupyter.launch.host.warm", *server_args],
                                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=subprocess.DEVNULL, start_new_session=True)
            except Exception as e:
                self.proc, self.error = None, f"{type(e).__name__}: {e}"
            started.set()
            if self.proc is not None:
                self.proc.wait()

        self.error = None
        threading.Thread(target=own, daemon=True, name="sdp-warm-pool").start()
        started.wait()

    def ready_line(self) -> bytes:
        return self.proc.stdout.readline() if self.proc is not None else b""

    def wait(self) -> int:
        return self.proc.wait() if self.proc is not None else 1

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc is not None else 1

    def close(self, wait: float) -> int:
        if self.proc is None:
            return 1
        try:
            self.proc.stdin.close()  # EOF: the server stops, and its ranks with it
            return self.proc.wait(timeout=wait)
        except Exception:
            self.proc.kill()
            return self.proc.wait()


class PoolChannel:
    """What warm_pool.Pool uses of its channel process (stdout.readline, stdin.close, poll, wait, kill),
    for a PoolActor: the pool of a Ray node, held by this process."""

    def __init__(self, actor):
        self.actor = actor
        self.stdout = self.stdin = self
        self.returncode: int | None = None

    def _call(self, method: str, *args, timeout: float | None = None, failed=-9):
        """One actor call, never after ray.shutdown(): Ray ends the whole process when its worker is
        used after shutdown (and the notebook's actors, these pools among them, ended with it)."""
        import ray

        if not ray.is_initialized():
            return failed
        try:
            return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)
        except Exception:  # the actor died (its node was lost, the cluster went away)
            return failed

    def readline(self) -> bytes:
        from sdp_jupyter.launch.host.warm import READY_TIMEOUT

        return self._call("ready_line", timeout=READY_TIMEOUT, failed=b"")

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._call("poll", timeout=10)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._call("wait", timeout=10 if timeout is None else timeout)
        return self.returncode

    def close(self) -> None:  # stdin.close(): the server stops
        self.returncode = self._call("close", 3.0, timeout=10)
        self.kill()

    def kill(self) -> None:
        import ray

        if not ray.is_initialized():
            return
        try:
            ray.kill(self.actor)
        except Exception:
            pass
