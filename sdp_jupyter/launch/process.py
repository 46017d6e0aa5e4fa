"""Process facts every side of a launch shares, each written once: where a rank finds this package
(its PYTHONPATH) and the parent-death signal that keeps no rank, agent, pool or
ssh client alive after the process that started it. A leaf: it imports nothing of ours, so the
kernel, the host and the rank (`python -m sdp_jupyter.launch.rank.worker`) can all use it.
"""
from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from sdp_jupyter._env import env_int

PACKAGE_PARENT = str(Path(__file__).resolve().parents[2])  # the folder holding sdp_jupyter/
COMPAT_DIR = str(Path(__file__).resolve().parents[1] / "_compat")  # the smdistributed stand-in

PR_SET_PDEATHSIG = 1
_expected_parent: int | None = None


def smdistributed_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("smdistributed") is not None
    except (ImportError, ValueError):
        return False


def rank_pythonpath(existing: str | None = None, compat: bool = True) -> str:
    """A rank's PYTHONPATH: the smdistributed stand-in when AWS's library is not installed (`compat`),
    this package's parent folder, then what was there (`existing`)."""
    paths = ([COMPAT_DIR] if compat and not smdistributed_installed() else []) + [PACKAGE_PARENT]
    return os.pathsep.join(paths + ([existing] if existing else []))


def expect_parent(pid: int) -> None:
    """The process this one must die with, when it is not $SDP_LAUNCHER_PID (a warm pool's fork)."""
    global _expected_parent
    _expected_parent = pid


def arm_parent_death_signal(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Linux: get `sig` when the thread that started this process goes away, and exit now if the
    parent already has (it died between fork and prctl). `parent`: the pid to check; None: the one
    set by expect_parent, else $SDP_LAUNCHER_PID; 0: no check (a child of a kernel thread)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the launchers' atexit hooks still apply
        pass
    if parent is None:
        parent = _expected_parent or env_int("SDP_LAUNCHER_PID", 0)
    if parent and os.getppid() != parent:
        os._exit(1)


_WITH_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, sys\n"
    f"ctypes.CDLL(None).prctl({PR_SET_PDEATHSIG}, int(sys.argv[1]), 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[2]):\n"  # the kernel died before the signal was armed
    "    os._exit(1)\n"
    "os.execv(sys.argv[3], sys.argv[3:])\n")


def _dies_with_parent(argv: list[str]) -> list[str]:
    """`argv` (its program resolved on PATH) run so that it gets SIGTERM when the thread that started
    it ends (the notebook died). FileNotFoundError when the program is not installed."""
    import errno
    import shutil
    import sys

    program = shutil.which(argv[0])
    if program is None:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", argv[0])
    if not sys.platform.startswith("linux") or not sys.executable:  # no parent-death signal: atexit hooks still apply
        return [program, *argv[1:]]
    return [sys.executable, "-I", "-S", "-c", _WITH_PARENT_DEATH_SIGNAL, str(int(signal.SIGTERM)),
            str(os.getpid()), program, *argv[1:]]


_KEEPER = None  # the queue of the thread that starts kept children
_KEEPER_LOCK = threading.Lock()


def start_kept(argv: list[str], env: dict | None = None):
    """A child with piped stdin, stdout and stderr (an ssh client, srun, a local node agent), started
    from one thread that lives as long as this process: the parent-death signal fires when the
    *thread* that forked a child ends, so a child started from a short-lived thread (a widget
    callback, a pool) would be killed with it. In its own session. FileNotFoundError when argv[0]
    is not installed."""
    global _KEEPER
    import queue
    import subprocess

    with _KEEPER_LOCK:
        if _KEEPER is None:
            _KEEPER = queue.Queue()

            def keep(inbox: queue.Queue) -> None:
                while True:
                    argv, env, reply = inbox.get()
                    try:
                        # no preexec_fn (not safe with threads): the wrapper arms the signal, then execs
                        reply.put(subprocess.Popen(_dies_with_parent(argv), stdin=subprocess.PIPE,
                                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                                                   start_new_session=True, close_fds=True))
                    except Exception as e:  # handed to the caller
                        reply.put(e)

            threading.Thread(target=keep, args=(_KEEPER,), daemon=True, name="sdp-child-keeper").start()
    reply: queue.Queue = queue.Queue()
    _KEEPER.put((argv, env, reply))
    proc = reply.get()
    if isinstance(proc, Exception):
        raise proc
    return proc
