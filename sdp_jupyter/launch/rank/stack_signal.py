"""A rank's Python stacks on request (Job.stacks(), %sdp_stacks, the hang sentence: docs/failures.md).

The worker arms this first thing: faulthandler writes every thread's Python stack into the rank's stacks
file (jobdir.stacks_path) when the rank gets SIGNAL. faulthandler's handler is C and async-signal-safe:
it needs no GIL and no Python code to run, so it answers while the main thread waits inside a collective,
sleeps, or loops in C code, and nothing attaches to the process (no ptrace, no debugger).

SIGNAL is a real-time signal: SIGUSR1 is what Slurm's `--signal`, PyTorch Lightning's requeue and
submitit use, SIGUSR2 is a session's cell interrupt (launch/rank/cell_loop.py); torch, Ray and glibc use
none of the real-time signals above glibc's own. Its default action kills, so the agent signals only a
rank whose handler is in place (`armed`), and only the rank itself, never its process group: a
DataLoader worker (forked, so it inherits the handler but not a reason to answer) is left alone.

The file starts with one header line, `# sdp-stacks {json}`: the main thread's id (faulthandler
names threads by id only), the folders whose frames are not the user's code (this Python's library
and site-packages, sdp_jupyter itself), so the kernel can say which frame is the user's, and the job
folder on this host (the kernel shows the job script's frames in its own copy, so equal stacks on
different hosts are equal).
"""
from __future__ import annotations

import json
import os
import signal
import sysconfig
import threading

SIGNAL = getattr(signal, "SIGRTMIN", signal.SIGUSR1) + (6 if hasattr(signal, "SIGRTMIN") else 0)
HEADER = "# sdp-stacks "


def library_folders() -> list[str]:
    """The folders of code that is not the user's: the standard library, site-packages, sdp_jupyter; and
    a session's job script, which is sdp_jupyter's loop that runs the cells (launch/rank/cell_loop.py)."""
    import sdp_jupyter
    from sdp_jupyter._env import env_str

    paths = sysconfig.get_paths()
    found = {os.path.join(p, "") for p in (paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")) if p}
    found.add(os.path.join(os.path.dirname(os.path.abspath(sdp_jupyter.__file__)), ""))
    if env_str("SDP_SESSION_CHANNEL") and env_str("SDP_SCRIPT"):
        found.add(os.path.abspath(os.environ["SDP_SCRIPT"]))
    return sorted(found)


def arm(job_dir: str, rank: int):
    """Open `rank`'s stacks file (emptied: one process's dumps), write its header, and register the
    dump on SIGNAL. The file stays open for the process's life (faulthandler holds it)."""
    from sdp_jupyter import jobdir
    import faulthandler

    path = jobdir.stacks_path(job_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)  # a rank started again (a restart, a session's replacement) starts clean
    f = jobdir.open_private(path, "ab", buffering=0)
    header = {"pid": os.getpid(), "main": f"0x{threading.main_thread().ident:016x}", "library": library_folders(),
              "job_dir": os.path.join(os.path.abspath(job_dir), "")}
    f.write((HEADER + json.dumps(header) + "\n").encode())
    # chain=False: the signal's default action (termination) must never run after the dump
    faulthandler.register(SIGNAL, file=f, all_threads=True, chain=False)
    return f
