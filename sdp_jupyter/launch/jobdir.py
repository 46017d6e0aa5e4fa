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
import stat
import time
from pathlib import Path

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


class UnsafeJobDir(PermissionError):
    """A job directory or file that others own or can write: we refuse to trust it."""


def ensure_private_dir(path: Path) -> Path:
    """Create `path` (and missing parents) as 0700, or check that the existing one is a real
    directory of this user, and make it 0700. Raises UnsafeJobDir otherwise."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise UnsafeJobDir(f"{path} is not a directory (a symbolic link?): refusing to use it for a job")
    if st.st_uid != os.geteuid():
        raise UnsafeJobDir(f"{path} belongs to user id {st.st_uid}, not to you: refusing to use it for a job. "
                           "Fix: choose another --name or --jobs-dir")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def write_private(path: Path, data: bytes | str) -> None:
    """Write `data` to `path` atomically as a 0600 file: a fresh temporary name opened with
    O_EXCL|O_NOFOLLOW (never a file or link someone placed there), then renamed over `path`."""
    path = Path(path)
    if isinstance(data, str):
        data = data.encode()
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def open_private(path: Path, mode: str = "ab"):
    """Open a job file for appending (logs, metrics), created 0600, never through a link."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.fdopen(os.open(path, flags, 0o600), mode)


def load_pickle(path: Path):
    """Unpickle a job file (push.pkl, result.pkl) only if it and its directory are ours and
    nobody else can write them: unpickling runs code, so a planted file must never be loaded."""
    path = Path(path)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        for what, st in (("file", os.fstat(f.fileno())), ("directory", os.stat(path.parent))):
            if st.st_uid != os.geteuid() or st.st_mode & 0o022:
                raise UnsafeJobDir(f"refusing to unpickle {path}: its {what} is not yours alone "
                                   f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
        return pickle.load(f)


def write_json_atomic(path: Path, data) -> None:
    write_private(path, json.dumps(data, indent=2, default=str))


def read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def prepare(job_dir: Path) -> None:
    """Create the job directory, clearing what a previous run of the same name left behind.

    checkpoints/ is kept: a re-run with the same name resumes from it (like a SageMaker spot restart).
    """
    ensure_private_dir(job_dir.parent)
    ensure_private_dir(job_dir)
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
