"""The job directory (docs/jobs.md): its contract in code. Every name in it, the one reader of its
JSON-lines files (`JsonLinesTail`), the one writer of files mirrored from elsewhere (`Mirror`), its
states and its liveness. No other module spells a job-directory file name: ranks, samplers, the
agent, the remote and SageMaker mirrors and the reader all ask here.

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
import re
import secrets
import shutil
import signal
import time
from pathlib import Path

from sdp_jupyter._files import (UnsafePath, ensure_private_dir, open_checked, open_private, private_writer,
                                write_private)
from sdp_jupyter._env import env_str

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
SESSION = "session"  # where earlier sessions kept their cells as files (now frames): still a job's entry
HEAL = "heal"  # a --heal job's membership records and its ranks' answers (sdp_jupyter.heal)
MODEL, OUTPUT, DATA = "model", "output", "data"
TRAIN_CHANNEL = f"{DATA}/train"  # SM_CHANNEL_TRAIN of a job that is not on SageMaker
# the SageMaker target's own entries: the code channel it uploads, the request it sent, a rehearsal's hosts
SAGEMAKER_SOURCE = "sagemaker_source"
SAGEMAKER_REQUEST = "sagemaker_request.json"
REHEARSAL = "rehearsal"
# a SageMaker job's directory inside the training container ($SM_OUTPUT_DATA_DIR/sdp_job), so also
# the folder of output.tar.gz that holds it
CONTAINER_JOB_DIR = "sdp_job"
# what a job directory may hold; a folder with anything else and no spec.json is not a job's
KNOWN_ENTRIES = frozenset({SCRIPT, SPEC, STATUS, RESULT, PUSH, LOGS, METRICS, CHECKPOINTS, SESSION, HEAL, MODEL, OUTPUT, DATA,
                           SAGEMAKER_SOURCE, "flight-request"})


def jobs_root(root: str | os.PathLike | None = None) -> Path:
    """`root`, else $SDP_JOBS_DIR, else ./sdp_jobs (absolute)."""
    return Path(root or env_str("SDP_JOBS_DIR") or "sdp_jobs").expanduser().absolute()


def new_job_name() -> str:
    return time.strftime("job-%Y%m%d-%H%M%S-") + secrets.token_hex(2)


# ---------------------------------------------------------------------------------------------- file names
def log_path(job_dir: str | os.PathLike, rank: int) -> Path:
    """A rank's output (stdout and stderr)."""
    return Path(job_dir) / LOGS / f"rank-{rank}.log"


def stacks_path(job_dir: str | os.PathLike, rank: int) -> Path:
    """Where a rank's Python stacks go when asked (launch/rank/stack_signal.py; read by its node's agent)."""
    return Path(job_dir) / LOGS / f"stacks-rank-{int(rank)}.txt"


def host_log_path(job_dir: str | os.PathLike, host: int) -> Path:
    """A SageMaker host's output (its CloudWatch stream, every rank of host algo-<host+1>)."""
    return Path(job_dir) / LOGS / f"algo-{host + 1}.log"


def agent_log_path(job_dir: str | os.PathLike, node: int) -> Path:
    """What a remote node's agent and its link said (kept when the job ends)."""
    return Path(job_dir) / LOGS / f"agent-node-{node}.log"


def sampler_log_path(job_dir: str | os.PathLike, node: int) -> Path:
    """A node's utilization sampler's own output."""
    return Path(job_dir) / LOGS / f"sampler-node-{node}.log"


def rank_metrics_path(job_dir: str | os.PathLike, rank: int) -> Path:
    """A rank's metrics lines (sdp_jupyter.report(), the DDP wrapper, the backend record)."""
    return Path(job_dir) / METRICS / f"rank-{rank}.jsonl"


def node_metrics_path(job_dir: str | os.PathLike, node: int) -> Path:
    """A node's utilization samples (monitor/sampler.py, or CloudWatch's for a SageMaker host)."""
    return Path(job_dir) / METRICS / f"system-node-{node}.jsonl"


def flight_metrics_name(rank: int) -> str:
    return f"flight-rank-{int(rank)}.jsonl"


def flight_metrics_path(job_dir: str | os.PathLike, rank: int) -> Path:
    """A rank's flight recorder lines (sdp_jupyter/comm/recorder.py): its rings and what it waits for.
    Beside the metrics, so that it travels back from remote hosts as they do; not a metrics file."""
    return Path(job_dir) / METRICS / flight_metrics_name(rank)


def flight_paths(job_dir: str | os.PathLike) -> list[Path]:
    return sorted((Path(job_dir) / METRICS).glob("flight-rank-*.jsonl"))


# one entry of a flight record's ring, in this order (sdp_jupyter/comm/recorder.py writes, sdp_jupyter/flight.py reads)
FLIGHT_FIELDS = ("seq", "op", "dtype", "count", "arg", "state", "posted", "started", "ended")
FLIGHT_REQUEST = "flight-request"


def flight_request_path(job_dir: str | os.PathLike) -> Path:
    """Touched to ask every rank of a live job for its flight recorder's ring (Job.flight())."""
    return Path(job_dir) / FLIGHT_REQUEST


_METRICS_NAME = re.compile(r"^(flight-)?(rank-\d+|system-node-\d+)\.jsonl$")


def is_metrics_name(name: str) -> bool:
    """Whether `name` is one of the metrics files above (or a rank's flight file): what an agent may
    send, never a path."""
    return bool(_METRICS_NAME.match(name))


def metrics_paths(job_dir: str | os.PathLike, ranks_only: bool = False, flight: bool = False) -> list[Path]:
    """The job's metrics files, sorted (only the ranks' with ranks_only; the flight files too with
    flight, for what forwards every file of the folder)."""
    paths = sorted((Path(job_dir) / METRICS).glob("rank-*.jsonl" if ranks_only else "*.jsonl"))
    return paths if flight else [p for p in paths if not p.name.startswith("flight-")]


# The private-file rules live in sdp_jupyter._files; these names stay importable from here.
UnsafeJobDir = UnsafePath


def heal_record_path(job_dir: str | os.PathLike, generation: int) -> Path:
    """A --heal job's membership at `generation`, written by its launcher: {generation, members, joining, left}."""
    return Path(job_dir) / HEAL / f"members-{generation:06d}.json"


def newest_heal_record(job_dir: str | os.PathLike, after: int = -1) -> dict | None:
    """A --heal job's newest membership record after generation `after`; None when there is none. The
    launcher numbers them without gaps, so this stats one file while nothing changes."""
    g = after
    while heal_record_path(job_dir, g + 1).exists():
        g += 1
    return read_json(heal_record_path(job_dir, g)) if g > after else None


def heal_ready_path(job_dir: str | os.PathLike, rank: int) -> Path:
    """Written by a --heal job's replacement rank once it can join (sdp_jupyter.heal)."""
    return Path(job_dir) / HEAL / f"ready-{rank}"


HEAL_FINISHED = "finished"  # the one heal file both the ranks (Healer.close) and the launcher's agents write


def heal_finished_path(job_dir: str | os.PathLike) -> Path:
    """Written by a --heal job's ranks when training ended (Healer.close): a replacement not let in leaves."""
    return Path(job_dir) / HEAL / HEAL_FINISHED


def heal_formed_path(job_dir: str | os.PathLike, generation: int, rank: int) -> Path:
    """Written by a --heal job's rank once its process group of `generation` is made."""
    return Path(job_dir) / HEAL / f"formed-{generation:06d}-{rank}"


_HEAL_ANSWER = re.compile(rf"^(ready-\d+|formed-\d{{6}}-\d+|{HEAL_FINISHED})$")
_HEAL_RECORD = re.compile(r"^members-\d{6}\.json$")


def is_heal_answer(name: str) -> bool:
    """A file a --heal job's rank writes in its host's heal folder (an agent sends it to the launcher)."""
    return bool(_HEAL_ANSWER.match(name))


def is_heal_record(name: str) -> bool:
    """A --heal job's membership record (the launcher sends it to every agent): only these names."""
    return bool(_HEAL_RECORD.match(name))


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


def describe_exit(code: int) -> str:
    """How a rank ended, from its exit status (negative: the signal that killed it), as errors say it."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


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
    for sub in (LOGS, METRICS, MODEL, OUTPUT, DATA, TRAIN_CHANNEL):
        ensure_private_dir(job_dir / sub)


LINE_CAP = 1 << 20  # a log line longer than this is cut when read back (the file keeps it whole);
                    # a metrics line longer than this is skipped (counted), never held whole
READ_CAP = 4 << 20  # at most this much of a JSON-lines file per read


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


# ---------------------------------------------------------------------------------------------- reading
def parse_record(line: bytes | str) -> dict | None:
    """One metrics line as a dict; None for a cut line, NUL bytes from a crash, text from elsewhere,
    or JSON that is not an object."""
    try:
        value = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


class JsonLinesTail:
    """Follows one JSON-lines file of the job directory (metrics/*.jsonl) as it grows: the one reader
    of those files, for the kernel's reader, the agent, the SageMaker entry and the one-shot readers.

    Bounded: a read() takes at most `read_cap` bytes (`behind` then says more is waiting), and a line
    longer than `line_cap` is dropped up to its newline and counted in `bad`, so one runaway line is
    never held whole. A partial last line is kept until its newline arrives; with `final` (its writer
    has ended) a last line without one counts as it is. A file that shrinks or is replaced by another
    (a new inode: a rotation, a re-run of the job) is read again from its start. Nothing here raises
    on bad data: a missing file reads as empty."""

    def __init__(self, path: str | os.PathLike, *, read_cap: int = READ_CAP, line_cap: int = LINE_CAP):
        self.path = os.fspath(path)
        self.read_cap, self.line_cap = read_cap, line_cap
        self.offset = 0
        self.ino = None
        self.rest = b""
        self.skipping = False  # inside an over-long line: drop bytes up to the next newline
        self.behind = False    # the last read() left bytes in the file
        self.bad = 0           # lines skipped: over line_cap, or (records()) not a JSON object

    def read(self, final: bool = False) -> list[bytes]:
        """The complete, non-blank lines (without their newline) that at most read_cap new bytes end."""
        try:
            st = os.stat(self.path)
        except OSError:
            self.behind = False
            return []
        if st.st_ino != self.ino or st.st_size < self.offset:
            self.ino, self.offset, self.rest, self.skipping = st.st_ino, 0, b"", False
        data = b""
        if st.st_size > self.offset:
            try:
                with open(self.path, "rb") as f:
                    f.seek(self.offset)
                    data = f.read(min(st.st_size - self.offset, self.read_cap))
            except OSError:
                pass
        self.offset += len(data)
        self.behind = bool(data) and st.st_size > self.offset
        if self.skipping:
            nl = data.find(b"\n")
            data, self.skipping = (b"", True) if nl < 0 else (data[nl + 1:], False)
        lines = []
        if data:
            pieces = (self.rest + data).split(b"\n")
            self.rest = pieces.pop()
            for line in pieces:
                if len(line) > self.line_cap:
                    self.bad += 1
                elif line.strip():
                    lines.append(line)
            if len(self.rest) > self.line_cap:
                self.bad += 1
                self.rest, self.skipping = b"", True
        if final and not self.behind and self.rest:
            if self.rest.strip():
                lines.append(self.rest)  # a finished writer's unterminated line: kept if it is whole
            self.rest = b""
        return lines

    def drain(self, final: bool = False) -> list[bytes]:
        """Every complete line there is now, read in pieces of at most read_cap bytes."""
        lines = self.read(final)
        while self.behind:
            lines += self.read(final)
        return lines

    def records(self, final: bool = False) -> list[dict]:
        """drain() parsed: the lines that are JSON objects; the others are counted in `bad`."""
        out = []
        for line in self.drain(final):
            record = parse_record(line)
            if record is None:
                self.bad += 1
            else:
                out.append(record)
        return out


# ---------------------------------------------------------------------------------------------- mirroring
class Mirror:
    """Writes what another machine produced (an agent's frames, a SageMaker job's CloudWatch streams
    and output archive) into a local job directory, under the directory's rules: files 0600, created
    never through a link someone placed there, in 0700 folders (docs/security.md: a rank's output
    and metrics can carry what the script printed, tokens included). Appended files stay open until
    close() (frames come many per second); a whole file is replaced atomically, so a reader never
    sees half of it. One writer thread per Mirror."""

    def __init__(self):
        self._files: dict[str, object] = {}

    def append(self, path: str | os.PathLike, text: str | bytes, flush: bool = True) -> None:
        key = os.fspath(path)
        f = self._files.get(key)
        if f is None:
            ensure_private_dir(Path(key).parent)
            f = self._files[key] = open_private(key, "ab")
        f.write(text.encode() if isinstance(text, str) else text)
        if flush:
            f.flush()

    def append_record(self, path: str | os.PathLike, record: dict, flush: bool = True) -> None:
        """One metrics line, compact, as the reporter writes them."""
        self.append(path, json.dumps(record, separators=(",", ":")) + "\n", flush)

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()

    def replace(self, path: str | os.PathLike, data) -> None:
        """`path`'s whole content from bytes or a binary file, renamed into place when complete."""
        ensure_private_dir(Path(path).parent)
        if isinstance(data, (bytes, bytearray, str)):
            write_private(path, data)
            return
        with private_writer(path) as out:
            shutil.copyfileobj(data, out)

    def close(self) -> None:
        files, self._files = self._files, {}
        for f in files.values():
            f.close()


def list_job_dirs(root: str | os.PathLike | None = None) -> list[Path]:
    base = jobs_root(root)
    if not base.is_dir():
        return []
    dirs = [d for d in base.iterdir() if (d / SPEC).is_file()]
    return sorted(dirs, key=lambda d: (d / SPEC).stat().st_mtime)


__all__ = ["STATES", "FINAL_STATES", "SCRIPT", "SPEC", "STATUS", "RESULT", "PUSH", "LOGS", "METRICS", "CHECKPOINTS",
           "MODEL", "OUTPUT", "DATA", "TRAIN_CHANNEL", "SAGEMAKER_SOURCE", "SAGEMAKER_REQUEST", "REHEARSAL", "CONTAINER_JOB_DIR",
           "KNOWN_ENTRIES", "LINE_CAP", "READ_CAP", "jobs_root", "new_job_name", "log_path", "stacks_path", "host_log_path",
           "agent_log_path", "sampler_log_path", "rank_metrics_path", "flight_metrics_name", "flight_metrics_path",
           "flight_paths", "FLIGHT_FIELDS", "FLIGHT_REQUEST", "flight_request_path", "node_metrics_path", "is_metrics_name",
           "metrics_paths", "UnsafeJobDir", "ensure_private_dir", "write_private", "open_private", "load_pickle",
           "write_json_atomic", "read_json", "describe_exit", "prepare", "read_log", "parse_record", "JsonLinesTail", "Mirror",
           "list_job_dirs"]
