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
    with jobdir.open_private(os.path.join(job_dir, jobdir.LOGS, "session-store.log")) as log:
        proc = subprocess.Popen([sys.executable, "-m", "sdp_jupyter.launch.rank.worker", "--module",
                                 "sdp_jupyter.launch.rank.store_server", addr, str(port)],
                                env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                start_new_session=True, close_fds=True)
    proc.where = f"{addr}:{port} (its log: {job_dir}/{jobdir.LOGS}/session-store.log)"
    return proc


def ready(proc: subprocess.Popen) -> None:
    """Wait until the store listens; RuntimeError (the store stopped) when it does not within READY_TIMEOUT."""
    import select

    said, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT)
    if not said or proc.stdout.readline().strip() != b"ready":
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the session's store did not start at {proc.where} within {READY_TIMEOUT:g} s "
                           f"(exit {proc.returncode})")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    try:
        proc.stdin.close()
        proc.wait(timeout=3)
    except Exception:  # noqa: BLE001 - stuck: killed
        proc.kill()
        proc.wait()
