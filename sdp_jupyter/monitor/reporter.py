"""Worker side: append one JSON line per step to this rank's metrics file.

`report(step=..., samples=..., loss=..., **more)` is what a training script calls; it writes
`{"t", "kind": "step", "rank", "step", ...}` to `$SDP_JOB_DIR/metrics/rank-<RANK>.jsonl` and flushes,
so the notebook sees the step at once and a killed job loses at most the line being written.

`emit(kind, **fields)` is the internal door for our own code (DDP wrapper, smddp backend, `timed`):
`emit("step", ...)` fields are *automatic step fields*. They are held and merged into the next
`report()` line, so that a step is one line with the user's loss next to the engine's comm time. When
no `report()` comes (a script that never calls it), the held fields are written as their own step
line as soon as a field would be overwritten (the next step has started), and at exit. Any other kind
is written at once.

Outside a job (`SDP_JOB_DIR` unset) every call is a no-op; the first one warns.
"""
from __future__ import annotations

import atexit
import json
import os
import threading
import time
import warnings
from typing import Any, Iterable, Iterator, TypeVar

from sdp_jupyter import jobdir
from sdp_jupyter._env import env_str

__all__ = ["report", "emit", "flush", "timed", "Reporter"]

T = TypeVar("T")


def _jsonable(value: Any):
    """json.dumps fallback: torch/numpy scalars, 0-d tensors -> Python numbers."""
    item = getattr(value, "item", None)
    if callable(item):
        try:
            return item()
        except (TypeError, ValueError, RuntimeError):
            pass
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class Reporter:
    """One per process. Owns the open metrics file and the held automatic step fields."""

    def __init__(self, job_dir: str | None, rank: int):
        self.job_dir = job_dir
        self.rank = rank
        self._file = None
        self._pid = None
        self._pending: dict[str, Any] = {}
        self._auto_step = 0          # next step number when none is given
        self._lock = threading.Lock()
        self._dumps = json.JSONEncoder(separators=(",", ":"), default=_jsonable).encode

    @property
    def path(self) -> str | None:
        if not self.job_dir:
            return None
        return str(jobdir.rank_metrics_path(self.job_dir, self.rank))

    def _open(self):
        # Reopen after fork: a child must not share the parent's buffered file object.
        if self._file is None or self._pid != os.getpid():
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            # 0600 and never through a link, as every file of a job directory (docs/security.md)
            self._file = jobdir.open_private(self.path, "a", buffering=1 << 16, encoding="utf-8")
            self._pid = os.getpid()
        return self._file

    def _write(self, record: dict) -> None:
        f = self._open()
        f.write(self._dumps(record) + "\n")
        f.flush()

    def report(self, step=None, samples=None, loss=None, **more) -> None:
        record = {"t": time.time(), "kind": "step", "rank": self.rank}
        with self._lock:
            if self._pending:
                record.update(self._pending)
                self._pending = {}
            if step is None:
                step = self._auto_step
            record["step"] = step
            if samples is not None:
                record["samples"] = samples
            if loss is not None:
                record["loss"] = loss
            if more:
                record.update(more)
            self._auto_step = (step + 1) if isinstance(step, int) else self._auto_step + 1
            self._write(record)

    def emit(self, kind: str, **fields) -> None:
        with self._lock:
            if kind != "step":
                self._write({"t": time.time(), "kind": kind, "rank": self.rank, **fields})
                return
            if any(k in self._pending for k in fields):
                self._flush_pending()
            self._pending.update(fields)

    def _flush_pending(self) -> None:
        if not self._pending:
            return
        record = {"t": time.time(), "kind": "step", "rank": self.rank, "step": self._auto_step}
        record.update(self._pending)
        record["auto"] = True
        self._pending = {}
        self._auto_step += 1
        self._write(record)

    def flush(self) -> None:
        with self._lock:
            self._flush_pending()
            if self._file is not None and self._pid == os.getpid():
                self._file.flush()

    def close(self) -> None:
        self.flush()
        with self._lock:
            if self._file is not None and self._pid == os.getpid():
                self._file.close()
            self._file = None


_reporter: Reporter | None = None
_warned = False
_init_lock = threading.Lock()


def _get() -> Reporter | None:
    global _reporter, _warned
    job_dir = env_str("SDP_JOB_DIR")
    if not job_dir:
        if not _warned:
            _warned = True
            warnings.warn(
                "sdp_jupyter.report(): SDP_JOB_DIR is not set, so this process is not part of an "
                "sdp_jupyter job; metrics are not recorded (this warning is shown once).",
                RuntimeWarning,
                stacklevel=3,
            )
        return None
    rep = _reporter
    if rep is None or rep.job_dir != job_dir:
        with _init_lock:
            if _reporter is None or _reporter.job_dir != job_dir:
                _reporter = Reporter(job_dir, int(os.environ.get("RANK", "0")))
                atexit.register(_reporter.close)
            rep = _reporter
    return rep


def report(step=None, samples=None, loss=None, **more) -> None:
    """Record one training step of this rank.

    step: step number (default: one more than the last); samples: samples this rank processed in
    the step (gives samples/s); loss: a number or 0-d tensor (`.item()` is called); more: any other
    numeric fields (e.g. `lr=`, `total_steps=` for the dashboard's ETA). Cheap enough for every step.
    """
    rep = _reporter if _reporter is not None and env_str("SDP_JOB_DIR") == _reporter.job_dir else _get()
    if rep is not None:
        rep.report(step, samples, loss, **more)


def emit(kind: str, **fields) -> None:
    """Internal: automatic metrics from our own code. See the module docstring and docs/monitoring.md."""
    rep = _reporter if _reporter is not None and env_str("SDP_JOB_DIR") == _reporter.job_dir else _get()
    if rep is not None:
        rep.emit(kind, **fields)


def flush() -> None:
    """Write held automatic step fields now (also done at exit)."""
    if _reporter is not None:
        _reporter.flush()


def timed(iterable: Iterable[T]) -> Iterator[T]:
    """Yield from `iterable`, recording how long each item took to arrive as the step's `data_wait`.

    `for x, y in timed(loader): ...` answers "is my job slowed down by I/O?": the dashboard flags a
    job as input-bound when data_wait is a large share of the step.
    """
    it = iter(iterable)
    clock = time.perf_counter
    while True:
        t0 = clock()
        try:
            item = next(it)
        except StopIteration:
            return
        emit("step", data_wait=clock() - t0)
        yield item
