"""The job directory (docs/jobs.md): where it is, what is in it, and atomic writes of its JSON files."""
from __future__ import annotations

import json
import os
import secrets
import shutil
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


def write_json_atomic(path: Path, data) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return default


def prepare(job_dir: Path) -> None:
    """Create the job directory, clearing what a previous run of the same name left behind.

    checkpoints/ is kept: a re-run with the same name resumes from it (like a SageMaker spot restart).
    """
    job_dir.mkdir(parents=True, exist_ok=True)
    for entry in job_dir.iterdir():
        if entry.name == CHECKPOINTS:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    for sub in (LOGS, METRICS, "model", "output", "data/train"):
        (job_dir / sub).mkdir(parents=True, exist_ok=True)


def tail_text(text: str, tail: int | None) -> str:
    """The last `tail` lines of `text` (all of it when tail is None)."""
    if tail is None:
        return text
    lines = text.splitlines(keepends=True)
    return "".join(lines[-int(tail):]) if int(tail) > 0 else ""


def list_job_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    base = jobs_root(root)
    if not base.is_dir():
        return []
    dirs = [d for d in base.iterdir() if (d / SPEC).is_file()]
    return sorted(dirs, key=lambda d: (d / SPEC).stat().st_mtime)
