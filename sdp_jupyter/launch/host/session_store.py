"""An interactive session's rendezvous store in a process of its own (launch/rank/store_server.py),
started, awaited and stopped from here.

A job's ranks meet through a TCPStore that rank 0 hosts, so rank 0's death takes the store with it,
and the other ranks' clients cannot reconnect to a new one. A session whose ranks are replaced when
they die (launch/kernel/session.py) runs its store here instead, started by the local run or by node
0's agent next to rank 0, dying with its launcher (the worker's parent-death signal); every rank is a
client (SDP_SESSION_STORE=1), so any rank, rank 0 included, can die and be started again.
"""
from __future__ import annotations

import subprocess
import sys

from sdp_jupyter import jobdir

READY_TIMEOUT = 60.0  # seconds for the store process to import torch and listen


def start(job_dir, addr: str, port: int) -> subprocess.Popen:
    """The store process for a session's job (the ranks may start meanwhile: their clients wait for it);
    `ready(proc)` then waits until it listens."""
    import os

    from sdp_jupyter.launch.process import rank_pythonpath

    env = dict(os.environ, SDP_LAUNCHER_PID=str(os.getpid()),
               PYTHONPATH=rank_pythonpath(os.environ.get("PYTHONPATH"), compat=False))
    log_path = os.path.join(job_dir, jobdir.LOGS, "session-store.log")
    with jobdir.open_private(log_path) as log:
        proc = subprocess.Popen([sys.executable, "-m", "sdp_jupyter.launch.rank.worker", "--module",
                                 "sdp_jupyter.launch.rank.store_server", addr, str(port)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, close_fds=True)
    proc.where, proc.log_path = f"{addr}:{port} (its log: {log_path})", log_path
    return proc


def ready(proc: subprocess.Popen) -> None:
    """Wait until the store listens; RuntimeError naming why (its exit and its log's last line) when it
    ended first or did not listen within READY_TIMEOUT."""
    import select

    said, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT)
    line = proc.stdout.readline().strip() if said else None
    if line == b"ready":
        return
    if line == b"":  # its output closed: it is ending (on a loaded machine its exit can come a while later)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        what = f"did not listen within {READY_TIMEOUT:g} s"
    else:
        what = f"ended (exit {proc.returncode}) before it listened"
    try:
        with open(proc.log_path, errors="replace") as f:
            last = [ln.strip() for ln in f if ln.strip()][-1:]
    except OSError:
        last = []
    raise RuntimeError(f"the job's store at {proc.where} {what}" + (f": {last[0]}" if last else ""))


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=3)
    except Exception:  # noqa: BLE001 - stuck: killed
        proc.kill()
        proc.wait()
