"""Job: the handle of one distributed job, live in this process or reopened from its directory.

A Job is a view over its job directory plus, while it runs in this process, the run that owns the
worker processes (through its nodes' agents: launch/kernel/agent_run/). Everything a Job reports (state,
exit codes, logs, result, metrics) can be read back from the directory alone, so a finished job can be
reopened in a new kernel.
"""
from __future__ import annotations

import collections
import importlib
import importlib.util
import os
import threading
import time
from pathlib import Path
from typing import Callable

from sdp_jupyter._display import Shown
from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel.job_flight import JobFlight
from sdp_jupyter.launch.kernel.job_words import JobWords
from sdp_jupyter.launch.spec import JobSpec

TAIL_LINES = 2000  # lines per rank kept in memory for views opened late; the log file has them all


#: modules that moved, as a job directory's status.json may still name them (`job_class`): old -> new prefix
_MOVED = {"sdp_jupyter.launch.kernel.sagemaker.job:": "sdp_jupyter.launch.targets.sagemaker.training_job:",
          "sdp_jupyter.launch.targets.sagemaker.job:": "sdp_jupyter.launch.targets.sagemaker.training_job:",
          "sdp_jupyter.launch.kernel.sagemaker.": "sdp_jupyter.launch.targets.sagemaker."}


class JobError(RuntimeError):
    """The job failed, was stopped or cannot do what was asked. Shown without our internals' traceback."""

    def __init__(self, message: str, job: "Job | None" = None):
        super().__init__(message)
        self.job = job

    def _render_traceback_(self):  # IPython: show the message, not a traceback through the launcher
        return [f"{type(self).__name__}: {line}" if i == 0 else line
                for i, line in enumerate(str(self).splitlines())]


class Job(Shown, JobWords):
    """Handle of a job. Use `sdp_jupyter.launch(...)` to start one, `Job.open(name)` to reopen one."""

    def __init__(self, spec: JobSpec, job_dir: str | os.PathLike, run=None):
        self.spec = spec
        self.dir = Path(job_dir).absolute()
        self.name = self.dir.name
        self.supervisor = run  # object with stop(); None for a reopened job
        self._lock = threading.RLock()
        self._status: dict = jobdir.read_json(self.dir / jobdir.STATUS, {}) or {}
        self._listeners: list[Callable[[int, str], None]] = []
        self._done_callbacks: list[Callable[["Job"], None]] = []
        self._tails: dict[int, collections.deque] = {}
        self._done = threading.Event()
        self._flight = JobFlight(self.dir, spec.env)  # the flight recorder's analyses of this job (see hang)
        if self._status.get("state") in jobdir.FINAL_STATES:
            self._done.set()

    # ------------------------------------------------------------------ reopening
    @classmethod
    def open(cls, name_or_dir: str | os.PathLike, root: str | os.PathLike | None = None) -> "Job":
        """Reopen a job from its directory (a path, or a name under the jobs root)."""
        path = Path(name_or_dir)
        if not (path / jobdir.SPEC).is_file():
            path = jobdir.jobs_root(root) / str(name_or_dir)
        spec_file = path / jobdir.SPEC
        if not spec_file.is_file():
            raise JobError(f"no job {str(name_or_dir)!r}: {spec_file} does not exist. "
                           f"List jobs with %sdp_jobs or sdp_jupyter.launch.list_jobs()")
        own = cls.recorded_class(jobdir.read_json(path / jobdir.STATUS, {}) or {}) if cls is Job else None
        if own is not None and own is not Job:  # e.g. a SageMaker job's class knows its logs (one per host)
            return own.open(path)
        return cls(JobSpec.from_json(spec_file.read_text()), path)

    @classmethod
    def class_record(cls) -> str:
        """What a launcher writes as status.json's `job_class` when its jobs reopen as this class."""
        return f"{cls.__module__}:{cls.__qualname__}"

    @staticmethod
    def recorded_class(status: dict):
        """The Job class status.json names (`job_class`, written by the launcher: the directory says what
        reopens it, so this module names no target); only one of ours, and only a Job. None otherwise."""
        where = status.get("job_class")
        for old, new in _MOVED.items():  # a job directory written before a module moved
            if isinstance(where, str) and where.startswith(old):
                where = new + where[len(old):]
        if not isinstance(where, str) or not where.startswith("sdp_jupyter.") or where.count(":") != 1:
            return None
        module, name = where.split(":")
        try:
            found = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
        return found if isinstance(found, type) and issubclass(found, Job) else None

    @classmethod
    def create_dir(cls, spec: JobSpec, push_bytes: bytes | None = None) -> tuple[Path, JobSpec]:
        """Make the job directory of a resolved spec (name set): script.py, spec.json, push.pkl.

        Refuses (SpecError on --name) while a job of that name is still running. Returns the
        directory and the spec as written (a script path made absolute). Launchers call this first.
        """
        from sdp_jupyter.launch.spec import SpecError

        job_dir = jobdir.jobs_root(spec.jobs_dir) / spec.name
        if (job_dir / jobdir.SPEC).is_file() and cls.open(job_dir).state in ("pending", "running"):
            raise SpecError("--name", f"job {spec.name} is still running; stop it (%sdp_stop {spec.name}) "
                                      "or choose another --name")
        if job_dir.is_dir() and not (job_dir / jobdir.SPEC).is_file() \
                and any(e.name not in jobdir.KNOWN_ENTRIES for e in job_dir.iterdir()):
            # re-running a name clears the old job's files: never do that to a folder that is not a job's
            raise SpecError("--name", f"{job_dir} exists and is not a job directory, so it is left alone; "
                                      "choose another --name or --jobs-dir")
        jobdir.prepare(job_dir)
        if spec.code is not None:
            # line 1 is the magic line, so line numbers in tracebacks are the cell's own: kept one line
            # when an option's value holds a line break (an --env value), which would end the comment
            magic = spec.to_magic_line().replace("\r", "\\r").replace("\n", "\\n")
            jobdir.write_private(job_dir / jobdir.SCRIPT, f"# {magic}\n{spec.code}\n")
        else:
            jobdir.write_private(job_dir / jobdir.SCRIPT, Path(spec.script).read_text())
            spec = spec.replace(script=str(Path(spec.script).resolve()))
        jobdir.write_private(job_dir / jobdir.SPEC, spec.to_json())
        if push_bytes is not None:
            jobdir.write_private(job_dir / jobdir.PUSH, push_bytes)
        return job_dir, spec

    # ------------------------------------------------------------------ status
    @property
    def live(self) -> bool:
        """True when this process owns the job's workers."""
        return self.supervisor is not None

    def _read_status(self) -> dict:
        """status.json as read now: what state, error, exit codes and the rest read (cheap: no analysis)."""
        with self._lock:
            if self.supervisor is None and not self._done.is_set():
                self._status = jobdir.seen_status(jobdir.read_json(self.dir / jobdir.STATUS, self._status) or {})
                st = self._status
                if st.get("state") in jobdir.FINAL_STATES:
                    self._done.set()
            return dict(self._status)

    @property
    def status(self) -> dict:
        """status.json as read now; while the job runs and a collective has waited longer than
        SDP_HANG_WARN_S, "hang" says who waits where (see `hang`)."""
        st = self._read_status()
        if st.get("state") == "running":
            hang = self.hang
            if hang:
                st["hang"] = hang
        return st

    @property
    def state(self) -> str:
        """Where the job is, from status.json: pending, running, succeeded, failed or stopped
        (jobdir.STATES; the last three are final)."""
        return self._read_status().get("state", "pending")

    # ------------------------------------------------------------------ the flight recorder (docs/failures.md)
    @property
    def hang(self) -> str | None:
        """While the job runs: who has waited where longer than SDP_HANG_WARN_S (20 s) and who has not
        arrived, from the ranks' flight recorders ("rank 3 (host h2) never entered all_reduce #7 of the
        default group; ranks 0-2 waited 25 s in it"); None when nothing waits that long. The job goes on."""
        with self._lock:
            running = self._status.get("state") == "running"
        return self._flight.hang(self.supervisor) if running else None

    @property
    def straggler(self) -> str | None:
        """A rank (and its host) that comes last to most collectives, with what it costs the others
        ("host h2 (rank 1) arrived last in 92% of 400 collectives, 180 ms late on average: about 21% of
        the job's time"), from the ranks' arrival times (sdp_jupyter.stragglers); None when no
        rank stands out."""
        return self._flight.straggler(final=self.done)

    def flight(self, wait: float = 3.0):
        """The flight recorder of every rank: asks a live job's ranks to write their rings (the job goes
        on), then analyses what the ranks wrote (a finished job: what they left). Returns a Finding: its
        `sentence` says what went wrong, if anything; shown in a notebook, a table of the last
        operations per rank, aligned by sequence number, the first disagreement marked."""
        if not self.done:
            self._flight.request_rings(self.world_size, getattr(self.supervisor, "request_flight", None), wait)
        return self._flight.analyse(self._read_status().get("first_failure"), live=not self.done)

    def stacks(self, ranks: list | None = None, wait: float = 5.0):
        """Every rank's Python stack now (or `ranks`'), equal stacks grouped, each group saying where it is
        (`where(rank)`): each node's agent signals its ranks, whose faulthandler writes, also inside a
        collective or C code (launch/kernel/stacks.py; docs/failures.md). A job running in this process."""
        from sdp_jupyter.launch.kernel import stacks

        return stacks.of_job(self, ranks, wait, JobError)

    @property
    def error(self) -> str | None:
        """Why the job failed or was stopped, as status.json says (ending with the flight recorder's
        sentence when it found a cause); None when there is no error."""
        return self._read_status().get("error")

    @property
    def exit_codes(self) -> list:
        """The ranks' exit codes of the last attempt once the job has ended (by rank); [] before."""
        return self._read_status().get("exit_codes") or []

    @property
    def restarts(self) -> int:
        """How many times the whole job was restarted after a rank failed (at most --max-restarts)."""
        return int(self._read_status().get("restarts") or 0)

    @property
    def done(self) -> bool:
        """True once the state is final: succeeded, failed or stopped."""
        return self.state in jobdir.FINAL_STATES

    @property
    def world_size(self) -> int:
        """Ranks in the job: what the launcher recorded once it resolved the spec, else the spec's count."""
        st = self._read_status()
        if st.get("world_size"):
            return int(st["world_size"])
        return self.spec.world_size

    @property
    def elapsed(self) -> float:
        """Seconds since the job started (since it was created while pending), up to its end once it has
        ended; 0.0 when status.json has no time yet."""
        st = self._read_status()
        start = st.get("started") or st.get("created")
        if not start:
            return 0.0
        return float((st.get("ended") or time.time()) - start)

    # ------------------------------------------------------------------ control
    def wait(self, timeout: float | None = None, *, raise_on_failure: bool = False) -> str:
        """Block until the job ends (or `timeout` seconds pass); return the state."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            # a live job sets the event; a reopened one is polled from disk
            self._done.wait(0.5 if left is None else min(0.5, left))
        if raise_on_failure:
            self.raise_for_state()
        return self.state

    def follow(self, write: Callable[[str], object] | None = None) -> str:
        """Block until the job ends, writing the shown ranks' output (--ranks-output) as it comes.

        Rank 0 alone is written as is; with ranks_output "all" a line several ranks printed is written
        once, `[ranks 0-7] text` (rank_groups.LineMerger), a rank's own line `[rank R] text`; with "raw"
        every rank's line with its own "[rank R] " prefix.
        KeyboardInterrupt reaches the caller (which decides whether to stop the job).
        """
        import sys

        from sdp_jupyter.launch.kernel.rank_groups import Stream

        write = write or sys.stdout.write
        stream = Stream(self.world_size, self.spec.ranks_output)
        stream.add_seen(self.subscribe(stream.add))

        def drain(final=False):
            text = stream.take(final)
            if text:
                write(text)
            sys.stdout.flush()

        try:
            while not self.done:
                self.wait(0.1)
                drain()
        finally:
            self.unsubscribe(stream.add)
            drain(final=True)
        return self.state

    def raise_for_state(self) -> None:
        """Raise JobError (with the error, naming the job) if the job failed or was stopped; return None
        otherwise, whether or not it has ended."""
        state = self.state
        if state == "failed":
            raise JobError(f"job {self.name} failed: {self.error or 'see its logs'}", self)
        if state == "stopped":
            raise JobError(f"job {self.name} was stopped{': ' + self.error if self.error else ''}", self)

    def stop(self, wait: bool = True) -> str:
        """Stop every rank (SIGINT, then SIGTERM, then SIGKILL after a grace period)."""
        if self.done:
            return self.state
        if self.supervisor is None:
            raise JobError(f"job {self.name} is not running in this process, so it cannot be stopped here")
        self.supervisor.stop()
        if wait:
            self.wait()
        return self.state

    # ------------------------------------------------------------------ outputs
    def logs(self, rank: int = 0, tail: int | None = None) -> str:
        """Rank `rank`'s merged stdout/stderr (the last `tail` lines if given)."""
        if not 0 <= int(rank) < max(self.world_size, 1):
            raise JobError(f"rank {rank} does not exist: job {self.name} has ranks 0..{self.world_size - 1}")
        path = jobdir.log_path(self.dir, int(rank))
        try:
            return jobdir.read_log(path, tail)
        except FileNotFoundError:
            return ""

    def result(self):
        """What rank 0's code returned (its last expression), unpickled."""
        path = self.dir / jobdir.RESULT
        if not path.is_file():
            state = self.state
            if state in ("pending", "running"):
                raise JobError(f"job {self.name} is still {state}: call job.wait() first")
            raise JobError(f"job {self.name} ({state}) left no result: rank 0's code must end with an "
                           "expression (like `model.state_dict()`); see job.logs(0)")
        return jobdir.load_pickle(path)

    def metrics(self):
        """The job's metrics: sdp_jupyter.monitor.reader.read(job) (a Frame) when the monitor is
        installed, else the raw metrics lines of docs/jobs.md as a list of dicts."""
        if importlib.util.find_spec("sdp_jupyter.monitor.reader") is not None:
            return importlib.import_module("sdp_jupyter.monitor.reader").read(self)
        return read_metrics_lines(self.dir)

    def dashboard(self, **kw):
        """The live dashboard of this job (sdp_jupyter.ui.dashboard); keywords such as
        `reference=other_job` go to `sdp_jupyter.ui.dashboard.dashboard`."""
        if importlib.util.find_spec("sdp_jupyter.ui.dashboard") is None:
            raise JobError("the dashboard is not installed (sdp_jupyter.ui.dashboard is missing)")
        from sdp_jupyter.ui.dashboard import dashboard

        return dashboard(self, **kw)

    def view(self):
        """The live job view widget (state, elapsed time, per-rank output, Stop button)."""
        from sdp_jupyter.ui.jobview import JobView

        return JobView(self)

    # ------------------------------------------------------------------ streaming to views
    def subscribe(self, listener: Callable[[int, str], None]) -> dict[int, list[str]]:
        """Call listener(rank, text) for every new output line; return the lines seen so far."""
        with self._lock:
            snapshot = {rank: list(lines) for rank, lines in self._tails.items()}
            if self.supervisor is None and not snapshot:
                snapshot = {r: self.logs(r, tail=TAIL_LINES).splitlines(keepends=True)
                            for r in range(self.world_size)}
            self._listeners.append(listener)
            return snapshot

    def unsubscribe(self, listener) -> None:
        """Stop calling a listener given to `subscribe` (nothing happens if it was not subscribed)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)

    def on_done(self, callback: Callable[["Job"], None]) -> None:
        """Call callback(job) once the job has ended (at once if it already has)."""
        with self._lock:
            if not self._done.is_set():
                self._done_callbacks.append(callback)
                return
        callback(self)

    # ------------------------------------------------------------------ used by runs
    def emit_output(self, rank: int, text: str) -> None:
        """Used by the launchers: record one output line of `rank` and pass it to every listener (a
        listener that raises is skipped)."""
        with self._lock:
            self._tails.setdefault(rank, collections.deque(maxlen=TAIL_LINES)).append(text)
            listeners = list(self._listeners)
        for listener in listeners:
            try:
                listener(rank, text)
            except Exception:  # a broken view must not stop the job's output
                pass

    def update_status(self, **fields) -> None:
        """Used by the launchers: merge `fields` into status.json (written atomically). A failed state's
        error gets the flight recorder's sentence on the cause appended."""
        if fields.get("state") == "failed" and fields.get("error"):
            # every target ends a failed job here: its error ends with the flight recorder's sentence
            fields["error"] = self._flight.explained(fields["error"],
                                                     fields.get("first_failure") or self._status.get("first_failure"))
        with self._lock:
            self._status.update(fields)
            jobdir.write_json_atomic(self.dir / jobdir.STATUS, self._status)
            final = self._status.get("state") in jobdir.FINAL_STATES
            callbacks = []
            if final and not self._done.is_set():
                self._done.set()
                callbacks, self._done_callbacks = self._done_callbacks, []
        for cb in callbacks:
            try:
                cb(self)
            except Exception as e:  # shown, never raised into the supervisor thread
                print(f"sdp_jupyter: a callback of job {self.name} failed: {e!r}")

    def __repr__(self) -> str:
        return f"<Job {self.name} {self.state} {self.elapsed:.1f}s>"


def read_metrics_lines(job_dir: str | os.PathLike) -> list[dict]:
    """Every JSON line under metrics/, sorted by time; tolerates partial and bad lines."""
    rows = [row for path in jobdir.metrics_paths(job_dir) for row in jobdir.JsonLinesTail(path).records(final=True)]
    rows.sort(key=lambda r: r.get("t", 0))
    return rows
