"""The source half of the metrics reader (sdp_jupyter.monitor.reader): where events come from.

A **source** yields *events*: plain dicts shaped like the metrics lines of docs/jobs.md
(`{"t", "kind": "step" | "system" | "sampler" | ..., ...}`). It implements `MetricsSource`:
`poll() -> list[dict]` (new events since the last call, never raises on bad data), `done() -> bool`
(no more events will come) and `info() -> dict` (best effort: `name`, `state`, `total_steps`,
`world_size`). `JobDirSource` tails a local job directory and keeps only lines of the types the
reader relies on (`valid_record`); `open_source` makes a source from a job, a job directory or a
source. Another source (a SageMaker job read through CloudWatch, monitor/cloudwatch.py) plugs in
here without the reader or the UI knowing where the numbers come from.
"""
from __future__ import annotations

import math
import os
from typing import Any, Protocol, runtime_checkable

from sdp_jupyter import jobdir

STEP_COLUMNS = ("step", "t", "loss", "samples", "step_time", "comm_time", "exposed_comm", "data_wait",
                "bytes_reduced")
SYSTEM_COLUMNS = ("t", "util", "mem_used", "mem_total", "power_w", "proc_util", "ncpu")
# the columns valid_record requires to be numbers or null (t and step have their own rules there)
_NUMERIC_FIELDS = tuple(k for k in STEP_COLUMNS + SYSTEM_COLUMNS if k not in ("t", "step"))


@runtime_checkable
class MetricsSource(Protocol):
    def poll(self) -> list[dict]:
        """New events since the last call (possibly none). Bad data is skipped, not raised."""

    def done(self) -> bool:
        """True when the job has ended and every event has been returned."""

    def info(self) -> dict:
        """Best-effort facts: name, state, total_steps, world_size (missing keys are unknown)."""


def job_dir_of(job_or_dir: Any) -> str:
    """A job directory from a path or from a launcher Job (any object with a directory attribute)."""
    if isinstance(job_or_dir, (str, os.PathLike)):
        return os.fspath(job_or_dir)
    for attr in ("dir", "job_dir", "path", "directory", "root"):
        value = getattr(job_or_dir, attr, None)
        if isinstance(value, (str, os.PathLike)):
            return os.fspath(value)
    raise TypeError(f"cannot find a job directory in {job_or_dir!r}: pass a Job, a path or a MetricsSource")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _index(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def valid_record(ev) -> bool:
    """Whether a parsed metrics line has the types the reader relies on. Valid JSON of the wrong
    types (a list as rank, t: Infinity, a string as samples) is a bad record, never an exception."""
    if not isinstance(ev, dict) or not _number(ev.get("t")) or not math.isfinite(ev["t"]):
        return False
    if not isinstance(ev.get("kind", ""), str):
        return False
    for k in ("rank", "node"):
        if k in ev and not _index(ev[k]):
            return False
    if "total_steps" in ev and ev["total_steps"] is not None and not _index(ev["total_steps"]):
        return False
    step = ev.get("step")
    if step is not None and not (_number(step) or isinstance(step, str)):
        return False
    for k in _NUMERIC_FIELDS:
        if ev.get(k) is not None and not _number(ev[k]):
            return False
    for k in ("source", "device"):
        if k in ev and not isinstance(ev[k], (str, int)):
            return False
    return True


def _load_json(path: str) -> dict:
    value = jobdir.read_json(path, {})
    return value if isinstance(value, dict) else {}


class JobDirSource:
    """Events from a local job directory: its metrics files (jobdir.metrics_paths), each followed by
    a jobdir.JsonLinesTail (bounded reads; partial, over-long and bad lines never raise)."""

    def __init__(self, job_dir: str):
        self.job_dir = os.path.abspath(job_dir)
        self.tails: dict[str, jobdir.JsonLinesTail] = {}
        self.invalid = 0  # JSON objects of the wrong types (valid_record)
        self.skipped = 0
        self._done = False

    def _state(self) -> str | None:
        return jobdir.read_status(self.job_dir).get("state")

    def poll(self) -> list[dict]:
        if self._done:
            return []
        final = self._state() in jobdir.FINAL_STATES  # read it first: lines written before it count
        for path in map(str, jobdir.metrics_paths(self.job_dir)):
            if path not in self.tails:
                self.tails[path] = jobdir.JsonLinesTail(path)
        events: list[dict] = []
        for tail in self.tails.values():
            for ev in tail.records(final):
                if valid_record(ev):
                    events.append(ev)
                else:
                    self.invalid += 1
        self.skipped = self.invalid + sum(tail.bad for tail in self.tails.values())
        self._done = final
        return events

    def done(self) -> bool:
        return self._done

    def info(self) -> dict:
        spec = _load_json(os.path.join(self.job_dir, jobdir.SPEC))
        status = jobdir.read_status(self.job_dir)
        info = {"name": spec.get("name") or os.path.basename(self.job_dir),
                "state": status.get("state"),
                "skipped_lines": self.skipped}
        if isinstance(status.get("world_size"), int):
            info["world_size"] = status["world_size"]
        nodes = _first(spec, "nodes", "num_nodes", "instance_count")
        per_node = _first(spec, "procs_per_node", "nproc_per_node", "gpus_per_node", "processes_per_node")
        if isinstance(nodes, int) and isinstance(per_node, int) and "world_size" not in info:
            info["world_size"] = nodes * per_node
        if isinstance(nodes, int):
            info["nodes"] = nodes
        total = _first(spec, "total_steps", "max_steps")
        if total is None and isinstance(spec.get("hyperparameters"), dict):
            total = _first(spec["hyperparameters"], "total_steps", "max_steps")
        if isinstance(total, int):
            info["total_steps"] = total
        return info


def _first(d: dict, *keys):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return None


def open_source(obj: Any) -> MetricsSource:
    """A MetricsSource from a job directory, a Job (its `metrics_source()` if it has one, else its
    directory) or an object that already is a source."""
    if isinstance(obj, (str, os.PathLike)):
        return JobDirSource(os.fspath(obj))
    make = getattr(obj, "metrics_source", None)
    if callable(make):
        return make()
    try:
        return JobDirSource(job_dir_of(obj))
    except TypeError:
        if isinstance(obj, MetricsSource):
            return obj
        raise
