"""One node's ranks of one attempt, as its agent runs them (launch/host/agent.py, for every target that
runs agents, the local one included): each rank's output read in
pieces of at most jobdir.LINE_CAP bytes, every byte into the rank's log, each piece handed on; each
exit put on one queue; and the ranks stopped together (ranks.stop: SIGINT, SIGTERM, SIGKILL).
A rank stopped by a signal (SIGSTOP: state T) for SDP_STOPPED_RANK_S holds every collective of its
peers until their SDP_TIMEOUT: it is killed, with a line in its log that says so, and ends as a
death does (the job fails or restarts, an elastic job re-forms, a session replaces it).

    node = NodeRanks(job_dir, on_piece, name="sdp-job-x")
    node.add(rank, proc)             # a Popen, or a warm pool's WarmProcess: same contract
    rank, code = node.exits.get()    # in the order the ranks end
"""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from pathlib import Path
from typing import Callable

from sdp_jupyter import jobdir
from sdp_jupyter._env import env_float
from sdp_jupyter.launch.host import ranks


def stopped(pid: int) -> bool:
    """Whether a process is stopped by a signal (state T; a debugger's tracing stop, t, is not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] == b"T"
    except (OSError, IndexError):
        return False


class NodeRanks:
    """The ranks of one attempt on this host. `on_piece(rank, raw)` is called from the rank's reader
    thread for every piece after it is in the log; `exits` gets (rank, exit code) as ranks end."""

    def __init__(self, job_dir: str | Path, on_piece: Callable[[int, bytes], None], name: str = "sdp",
                 job_env: dict | None = None):
        self.job_dir, self.on_piece, self.name = Path(job_dir), on_piece, name
        self.procs: list = []
        self.exits: queue.Queue = queue.Queue()
        self._readers: dict[int, threading.Thread] = {}
        self._index: dict[int, int] = {}  # rank -> its place in procs
        # 0: never. The job's --env first (it reaches every host's agent), then this process's own
        self.stopped_limit = env_float("SDP_STOPPED_RANK_S", 10.0, min=0.0, environ={**os.environ, **(job_env or {})})
        self._watch: threading.Thread | None = None
        self._watch_lock = threading.Lock()

    def add(self, rank: int, proc) -> None:
        """Watch `proc` as `rank`; a rank added again (a replacement after its process ended) takes the
        old one's place: its output goes on in the same log, its exit comes on the same queue."""
        if rank in self._index:
            self.procs[self._index[rank]] = proc
        else:
            self._index[rank] = len(self.procs)
            self.procs.append(proc)
        reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True, name=f"{self.name}-out{rank}")
        reader.start()
        self._readers[rank] = reader
        threading.Thread(target=lambda: self.exits.put((rank, proc.wait())), daemon=True,
                         name=f"{self.name}-wait{rank}").start()
        with self._watch_lock:
            if self.stopped_limit and (self._watch is None or not self._watch.is_alive()):
                self._watch = threading.Thread(target=self._watch_stopped, daemon=True, name=f"{self.name}-stopped")
                self._watch.start()

    def _watch_stopped(self) -> None:
        """Once a second while a rank lives: a rank stopped for `stopped_limit` seconds is killed."""
        since: dict[int, float] = {}  # rank -> when it was first seen stopped
        while True:
            time.sleep(1.0)
            with self._watch_lock:
                live = [(rank, self.procs[i]) for rank, i in self._index.items() if self.procs[i].poll() is None]
                if not live:
                    self._watch = None
                    return
            now = time.monotonic()
            for rank, proc in live:
                if not stopped(proc.pid):
                    since.pop(rank, None)
                elif now - since.setdefault(rank, now) >= self.stopped_limit:
                    since.pop(rank)
                    note = (f"[sdp_jupyter] rank {rank} (pid {proc.pid}) was stopped by a signal (SIGSTOP) for "
                            f"{self.stopped_limit:g} s: killed, as a rank that does not run holds every collective "
                            "of its peers (SDP_STOPPED_RANK_S; 0 never kills)\n").encode()
                    with jobdir.open_private(jobdir.log_path(self.job_dir, rank)) as log:
                        log.write(note)
                    self.on_piece(rank, note)
                    ranks.signal_group(proc.pid, signal.SIGKILL)

    def proc(self, rank: int):
        """`rank`'s process (its latest, after a respawn), None for a rank this node does not run."""
        return self.procs[self._index[rank]] if rank in self._index else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def last_lines(self, rank: int, timeout: float = 2.0) -> None:
        """Wait (up to `timeout`) until a rank's reader has handed on its last piece."""
        reader = self._readers.get(rank)
        if reader is not None:
            reader.join(timeout=timeout)

    def join_readers(self, timeout: float = 2.0) -> None:
        for rank in list(self._readers):
            self.last_lines(rank, timeout)

    def stop(self, sigint_grace: float, sigterm_grace: float) -> list:
        """Stop every live rank (SIGINT, then SIGTERM, then SIGKILL to its process group); exit codes."""
        return ranks.stop(self.procs, sigint_grace, sigterm_grace)

    def kill_groups(self) -> None:
        """After the ranks exited: whatever they left in their process groups goes too."""
        ranks.kill_groups(self.procs)

    def _read(self, rank: int, proc) -> None:
        cap = jobdir.LINE_CAP
        with jobdir.open_private(jobdir.log_path(self.job_dir, rank)) as log:
            for raw in iter(lambda: proc.stdout.readline(cap), b""):
                log.write(raw)
                log.flush()
                self.on_piece(rank, raw)
        proc.stdout.close()
