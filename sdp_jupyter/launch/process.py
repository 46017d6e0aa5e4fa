"""Process facts every side of a launch shares, each written once: where a rank finds this package
(its PYTHONPATH) and the parent-death signal that keeps no rank, agent, pool or
ssh client alive after the process that started it. A leaf: it imports nothing of ours, so the
kernel, the host and the rank (`python -m sdp_jupyter.launch.rank.worker`) can all use it.
"""
from __future__ import annotations

import os
import signal
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
