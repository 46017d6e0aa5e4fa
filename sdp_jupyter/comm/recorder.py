"""The flight recorder, rank side: what this process's engines did last, written where the notebook reads it.

Every engine keeps a ring of its last SDP_FLIGHT_ENTRIES collectives (native/include/sdp/flight.h). This
module writes them, and what each rank is waiting for, as JSON lines into the rank's own file of the
job directory, `metrics/flight-rank-<RANK>.jsonl` (jobdir.flight_metrics_path), so that they travel
back from SSH, Ray and Slurm hosts with the metrics. Under plain torchrun, where there is no job
directory, SDP_FLIGHT_DIR names the folder; with neither, nothing is written.

Two kinds of line (the analyser, sdp_jupyter/flight.py, reads both):

- `{"kind": "flight", "reason", "rank", "group", "error", "fields", "entries"}`: a ring, oldest first,
  one entry a list in the order of `fields`. Written when a collective or message fails, when the rank
  is stopped (a responsive rank: one stuck in a collective cannot run Python), when a collective has
  waited SDP_HANG_WARN_S (once per wait), and on request (`Job.flight()`: the request file's time
  changes).
- `{"kind": "flight-live", "rank", "group", "state": "waiting"|"idle", "since", "last"}`: written every
  SDP_HANG_WARN_S (a line a rank per 20 s by default): whether the rank waits in a collective (which,
  since when) or runs its own code after one. A rank whose lines stop is frozen or dead: the analyser
  tells which from the time of its last line and the job's exit codes.

One watchdog thread per process, started with the first group; it only reads the engines' rings
(a lock the engine holds for microseconds), so the collectives themselves never pay for it beyond
the ring's few stores.
"""
from __future__ import annotations

import atexit
import json
import os
import socket
import threading
import time
import weakref

from sdp_jupyter import _engine, jobdir
from sdp_jupyter._env import env_float, env_str
from sdp_jupyter.comm.codes import COLLECTIVES

FIELDS = jobdir.FLIGHT_FIELDS
_COLL = {r["code"]: name for name, r in COLLECTIVES.items()}
_DTYPE = {int(v): name for name, v in _engine.DType.__members__.items()}
_OP = {int(v): name for name, v in _engine.ReduceOp.__members__.items()}
_STATE = {int(v): name for name, v in _engine.FlightState.__members__.items()}
_ROOTED = {name for name, r in COLLECTIVES.items() if r["rooted"]}
_REDUCING = {name for name, r in COLLECTIVES.items() if r["reduces"]}

_lock = threading.Lock()
_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # communicator -> its watch record
_thread: threading.Thread | None = None
_request_seen: float | None = None
_dumped_failure: "weakref.WeakSet" = weakref.WeakSet()


def entry(raw: tuple) -> list:
    """One ring entry from the engine (flight.h) in FIELDS' order, with names instead of codes; `arg` is
    the root of a rooted collective, the reduce op of a reducing one, else None."""
    seq, coll, dtype, op, count, root, state, posted, started, ended = raw
    name, dname = _COLL.get(coll, str(coll)), _DTYPE.get(dtype, str(dtype))
    arg = None
    if name in _ROOTED:
        arg = root
    elif name in _REDUCING:
        arg = _OP.get(op, str(op))
    return [seq, name, dname, count, arg, _STATE.get(state, str(state)), round(posted, 6), round(started, 6),
            round(ended, 6)]


def folder() -> str | None:
    """Where this rank's flight file goes: the job directory's metrics folder, else SDP_FLIGHT_DIR."""
    job_dir = env_str("SDP_JOB_DIR")
    if job_dir:
        return str(jobdir.flight_metrics_path(job_dir, 0).parent)
    return env_str("SDP_FLIGHT_DIR") or None


_process_rank: int | None = None  # this process's global rank, for its file's name (see watch)


def _rank() -> int:
    return _process_rank or 0


def _write(record: dict) -> None:
    where = folder()
    if not where:
        return
    path = os.path.join(where, jobdir.flight_metrics_name(_rank()))
    line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
    try:
        os.makedirs(where, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, line.encode())  # one write of one line: a reader never sees half of it
        finally:
            os.close(fd)
    except OSError:
        pass  # a full disk or a removed job directory must not turn a report into a second failure


def _base(c, kind: str) -> dict:
    return {"t": time.time(), "kind": kind, "rank": _rank(), "group": getattr(c, "group_name", "default"),
            "group_rank": c.rank, "world_size": c.world_size, "node": getattr(c, "node", None),
            "host": socket.gethostname(), "pid": os.getpid()}


def ring(c, last: int = 0) -> list[list]:
    try:
        return [entry(raw) for raw in c._engine.flight(last)]  # noqa: SLF001 - the communicator's own engine
    except Exception:  # noqa: BLE001 - a closed engine has nothing to say
        return []


def dump(c, reason: str, error: str = "") -> None:
    """Write communicator `c`'s ring (see the module's docstring)."""
    _write({**_base(c, "flight"), "reason": reason, "error": error, "fields": FIELDS, "entries": ring(c)})


def failed(c, error: str) -> None:
    """A collective or message of `c` failed with `error`: its ring, once per group."""
    with _lock:
        if c in _dumped_failure:
            return
        _dumped_failure.add(c)
    dump(c, "failed", error)


def dump_all(reason: str) -> None:
    """Every open group's ring (a stop, a request)."""
    with _lock:
        groups = list(_groups)
    for c in groups:
        dump(c, reason)


def watch(c) -> None:
    """Start watching a new communicator (the watchdog starts with the first one)."""
    global _thread, _process_rank
    with _lock:
        if _process_rank is None:
            # RANK as launchers and torchrun set it; without it (mp.spawn passing rank= itself) the first
            # group's rank, which is the default group's: torch makes that one first
            env = (os.environ.get("RANK") or "").strip()
            _process_rank = int(env) if env.isdigit() else int(c.rank)
        _groups[c] = {"warned": None, "live_at": 0.0, "reported": 0, "window_at": time.time()}
        if _thread is None or not _thread.is_alive():
            # read here, in the thread making the group: a bad value fails it, naming the variable,
            # instead of ending the watchdog thread unseen
            settings = (env_float("SDP_FLIGHT_POLL_S", 1.0, min=0.05), env_float("SDP_ARRIVALS_S", 5.0, min=0.1),
                        env_float("SDP_HANG_WARN_S", 20.0, min=0.1))
            _thread = threading.Thread(target=_watchdog, args=settings, name="smddp-flight", daemon=True)
            _thread.start()
            atexit.register(_at_exit)


def _at_exit() -> None:
    """A rank leaving after a failure its script did not handle: the ring of every broken group is
    written, and the group is shut down now, so that the failure this rank saw reaches its peers as
    the cause before its connections close (and they blame its exit instead)."""
    with _lock:
        records = list(_groups.items())
    groups = [c for c, _ in records]
    if env_str("SDP_JOB_DIR"):
        for c, rec in records:  # the last window's arrivals, however short the job
            try:
                _arrivals(c, rec, time.time())
            except Exception:  # noqa: BLE001
                pass
    for c in groups:
        try:
            broken = c._engine.broken_message()  # noqa: SLF001
        except Exception:  # noqa: BLE001
            continue
        if broken or c in _dumped_failure:
            failed(c, broken)
            try:
                c._engine.shutdown()  # noqa: SLF001
            except Exception:  # noqa: BLE001
                pass


def forget(c) -> None:
    with _lock:
        _groups.pop(c, None)


def request_path() -> str | None:
    job_dir = env_str("SDP_JOB_DIR")
    if job_dir:
        return str(jobdir.flight_request_path(job_dir))
    where = env_str("SDP_FLIGHT_DIR")
    return os.path.join(where, jobdir.FLIGHT_REQUEST) if where else None


def _requested() -> bool:
    global _request_seen
    path = request_path()
    if not path:
        return False
    try:
        stamp = os.stat(path).st_mtime_ns
    except OSError:
        return False
    first = _request_seen is None
    if stamp == _request_seen:
        return False
    _request_seen = stamp
    return not first or time.time_ns() - stamp < 5e9  # an old request left from before this rank started: not ours


def _check(c, rec: dict, warn_s: float, now: float) -> None:
    """Every warn_s, where this group is (waiting in a collective, or idle after one); the whole
    ring once when a wait passes warn_s."""
    last = ring(c, 1)
    if not last:
        return
    newest = last[-1]
    state, posted, started, ended = newest[5], newest[6], newest[7], newest[8]
    waiting = state in ("posted", "started")
    since = (started or posted) if waiting else ended
    if waiting and now - since >= warn_s and rec["warned"] != newest[0]:
        rec["warned"] = newest[0]
        dump(c, "waiting")
    if now - rec["live_at"] < warn_s:
        return
    rec["live_at"] = now
    _write({**_base(c, "flight-live"), "state": "waiting" if waiting else "idle", "since": since, "last": newest,
            "fields": FIELDS, "every": warn_s})


def _cpus() -> int:
    """The CPUs this rank may run on (its host's, or its container's or cgroup's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _arrivals(c, rec: dict, now: float) -> None:
    """When this rank came to each collective finished since the last call (the newest 256 at most),
    and how long it spent in them, as one metrics line (kind "arrivals"): the notebook lines the ranks'
    lines up by sequence number to see who comes last and what that costs the others (stragglers,
    sdp_jupyter.flight.stragglers; the dashboard's per-rank panel)."""
    done = [e for e in ring(c, 256) if e[5] == "finished" and e[0] > rec["reported"]]
    if not done:
        return
    rec["reported"] = done[-1][0]
    base = done[0][6]
    from sdp_jupyter.monitor.reporter import emit  # a rank's own metrics file, one writer

    emit("arrivals", group=getattr(c, "group_name", "default"), host=socket.gethostname(), cpus=_cpus(),
         seq0=done[0][0], base=base,
         posted_ms=[round((e[6] - base) * 1e3, 2) for e in done],
         wait_ms=[round((e[8] - e[6]) * 1e3, 2) for e in done], window_s=now - rec["window_at"])
    rec["window_at"] = now


def _watchdog(poll: float, every: float, warn_s: float) -> None:
    in_job = bool(env_str("SDP_JOB_DIR"))
    while True:
        time.sleep(poll)
        with _lock:
            groups = list(_groups.items())
        if not groups:
            continue
        if _requested():
            for c, _ in groups:
                dump(c, "request")
        now = time.time()
        for c, rec in groups:
            try:
                _check(c, rec, warn_s, now)
                if in_job and now - rec["window_at"] >= every:
                    _arrivals(c, rec, now)
            except Exception:  # noqa: BLE001 - the watchdog never takes the rank down
                pass

