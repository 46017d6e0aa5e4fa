"""The job directory (docs/jobs.md): where it is, what is in it, and atomic writes of its files.

A job directory can hold tokens (a cell's code, --env values in spec.json) and pickles that a rank
or the notebook will unpickle, so it is private: directories 0700, files 0600, created with
O_EXCL|O_NOFOLLOW under unpredictable temporary names and renamed into place. A directory owned
by someone else is refused, and a pickle is loaded only from a private directory of ours
(docs/security.md).
"""
from __future__ import annotations

import json
import os
import pickle
import secrets
import shutil
import time
from pathlib import Path

from sdp_jupyter._files import UnsafePath, ensure_private_dir, open_checked, open_private, write_private

STATES = ("pending", "running", "succeeded", "failed", "stopped")
FINAL_STATES = ("succeeded", "failed", "stopped")

SCRIPT = "script.py"
SPEC = "spec.json"
STATUS = "status.json"
RESULT = "result.pkl"
PUSH = "push.pkl"
LOGS = "logs"
METRICS = "metrics"
CHECKPOINTS = "checkpoints"
# what a job directory may hold; a folder with anything else and no spec.json is not a job's
KNOWN_ENTRIES = frozenset({SCRIPT, SPEC, STATUS, RESULT, PUSH, LOGS, METRICS, CHECKPOINTS, "model", "output",
                           "data", "sagemaker_source"})


def jobs_root(root: str | os.PathLike | None = None) -> Path:
    """`root`, else $SDP_JOBS_DIR, else ./sdp_jobs (absolute)."""
    return Path(root or os.environ.get("SDP_JOBS_DIR") or "sdp_jobs").expanduser().absolute()


def new_job_name() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


def log_path(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / LOGS / f"rank-{rank}.log"


# The private-file rules live in sdp_jupyter._files; these names stay importable from here.
UnsafeJobDir = UnsafePath


def load_pickle(path: Path):
    """Unpickle a job file (push.pkl, result.pkl) only if it and its directory are ours and
    nobody else can write them: unpickling runs code, so a planted file must never be loaded."""
    with open_checked(path, mask=0o022) as f:
        return pickle.load(f)


def write_json_atomic(path: Path, data) -> None:
    write_private(path, json.dumps(data, indent=2, default=str))


def read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def pid_alive(pid) -> bool:
    """Whether a process still runs: one we may not signal runs; a zombie has ended."""
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError, OverflowError):
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


def seen_status(status: dict) -> dict:
    """A status as every reader of the directory must take it (the job view, the dashboard, list_jobs).

    A job whose status.json still says pending or running can never finish once its launcher is gone
    (the kernel was killed): it reads as failed, saying so. Without a recorded launcher, the ranks'
    pids decide (all gone: failed); with neither there is no telling, and the state stands."""
    if status.get("state") not in ("pending", "running"):
        return status
    launcher, pids = status.get("launcher_pid"), status.get("pids")
    if launcher:
        if pid_alive(launcher):
            return status
        why = f"the launcher (pid {launcher}) is gone; the job did not finish"
    elif isinstance(pids, list) and pids and not any(pid_alive(p) for p in pids):
        why = "every process of the job is gone; the job did not finish"
    else:
        return status
    return dict(status, state="failed", error=why)


def read_status(job_dir: str | os.PathLike) -> dict:
    """status.json of a job directory, as seen_status() takes it ({} when there is none yet)."""
    status = read_json(Path(job_dir) / STATUS, {})
    return seen_status(status if isinstance(status, dict) else {})


def prepare(job_dir: Path) -> None:
    """Create the job directory, clearing what a previous run of the same name left behind.

    checkpoints/ is kept: a re-run with the same name resumes from it (like a SageMaker spot restart).
    """
    try:
        ensure_private_dir(job_dir.parent)
        ensure_private_dir(job_dir)
    except UnsafeJobDir as exc:
        raise UnsafeJobDir(f"{exc} for a job. Fix: choose another --name or --jobs-dir") from None
    for entry in job_dir.iterdir():
        if entry.name == CHECKPOINTS:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    for sub in (LOGS, METRICS, "model", "output", "data", "data/train"):
        ensure_private_dir(job_dir / sub)


LINE_CAP = 1 << 20  # a log line longer than this is cut when read back (the file keeps it whole)


def read_log(path: Path, tail: int | None = None, line_cap: int = LINE_CAP) -> str:
    """A rank's log as text: the last `tail` lines (all when None), each cut at `line_cap` bytes,
    read line by line so that one 64 MiB line is never held whole."""
    from collections import deque

    lines: deque = deque(maxlen=int(tail) if tail is not None else None)
    if tail is not None and int(tail) <= 0:
        return ""
    with open(path, "rb") as f:
        while True:
            piece = f.readline(line_cap)
            if not piece:
                break
            if not piece.endswith(b"\n") and len(piece) >= line_cap:
                while True:  # skip the rest of an over-long line
                    more = f.readline(line_cap)
                    if not more or more.endswith(b"\n"):
                        break
                piece += f" … [line cut at {line_cap} bytes]\n".encode()
            lines.append(piece)
    return b"".join(lines).decode("utf-8", errors="replace")


def list_job_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    base = jobs_root(root)
    if not base.is_dir():
        return []
    dirs = [d for d in base.iterdir() if (d / SPEC).is_file()]
    return sorted(dirs, key=lambda d: (d / SPEC).stat().st_mtime)


__all__ = ["STATES", "FINAL_STATES", "SCRIPT", "SPEC", "STATUS", "RESULT", "PUSH", "LOGS", "METRICS", "CHECKPOINTS",
           "KNOWN_ENTRIES", "LINE_CAP", "jobs_root", "new_job_name", "log_path", "UnsafeJobDir",
           "ensure_private_dir", "write_private", "open_private", "load_pickle", "write_json_atomic", "read_json",
           "prepare", "read_log", "list_job_dirs"]
