"""What every target's supervisor does the same way: restarts, naming the rank that caused a
failure, and stopping what runs at exit.

A run (a AgentRun: local, SSH, Ray, Slurm) registers itself while it runs; at interpreter exit every registered run's
`kill_now()` is called and its job marked stopped. `with_restarts` is the attempt loop behind
`--max-restarts`. When one rank fails, its peers' collectives fail too, and their exits often reach
the supervisor first: each run waits up to SETTLE_S for the other exits, then `first_cause` picks the
rank the job's error names.
"""
from __future__ import annotations

import atexit
import re
import threading
import time
from typing import Callable

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel import rank_groups, rank_report

SETTLE_S = 1.0  # after a rank's failure: how long the other ranks' exits are awaited before naming the cause

# The last line of a rank that failed because a peer went away: smddp names the peer's rank; gloo
# and the c10d errors name only an address.
_LOST_A_PEER = re.compile(r"SmddpBackendError: (?:.*?\brank (\d+)\b)?"
                          r"|Connection (?:closed|reset) by peer|gloo/transport/.*Read error|DistBackendError")

_ACTIVE: set = set()
_LOCK = threading.Lock()


def register(run) -> None:
    with _LOCK:
        _ACTIVE.add(run)


def unregister(run) -> None:
    with _LOCK:
        _ACTIVE.discard(run)


class Run:
    """A job's supervisor thread, started once; `stop(reason)` asks it to stop the job's ranks.
    Subclasses set up their state, call `Run.__init__(self, name)` and implement `_supervise`
    and `kill_now`."""

    def __init__(self, name: str):
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._thread = threading.Thread(target=self._supervise, name=name, daemon=True)

    def start(self) -> None:
        register(self)
        self._thread.start()

    def stop(self, reason: str | None = None) -> None:
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """True once `stop` was asked."""
        return self._stop.is_set()

    @property
    def stop_reason(self) -> str | None:
        """Why the run was asked to stop (the first reason given), None if not asked or said."""
        return self._stop_reason

    def _supervise(self) -> None:
        raise NotImplementedError

    # an interactive session's channel (launch/kernel/session.py); the targets that can run one implement it
    def open_session(self, replace: bool = False) -> None:
        """This job is a session: its ranks' answers come into `session_mail` as (kind, n, rank, data:
        a pickle), kind "ready" or "done". `replace`: a rank that dies waits in lost_ranks() for
        replace_rank instead of failing the job (where supported)."""

    def send_cell(self, n: int, data: bytes) -> None:
        """Give every rank cell `n` (a pickle)."""
        raise NotImplementedError

    def interrupt_ranks(self) -> None:
        """A KeyboardInterrupt in the cell each rank is running (launch/rank/cell_loop.py: INTERRUPT)."""
        raise NotImplementedError

    def lost_ranks(self) -> dict:
        """A session's ranks that died and wait for replace_rank: {rank: why}. Targets that cannot start
        one rank again end the session instead (the job fails) and return {}."""
        return {}

    def gone_ranks(self) -> dict:
        """A session's ranks lost with their host (its agent's link ended or went silent), which no
        replace_rank can start again: {rank: why}. Only a remote target loses a host."""
        return {}

    def drop_ranks(self, ranks: list) -> None:
        """The session goes on without these ranks (they were lost with their host): forget them."""

    def replace_rank(self, rank: int, join: str) -> None:
        """Start a session's dead rank again, with SDP_SESSION_JOIN=`join` (generation:cell:members) added
        to its environment (the session records the replacement, launch/kernel/session.py)."""
        raise NotImplementedError

    def kill_now(self) -> None:
        raise NotImplementedError


def with_restarts(job, attempt: Callable[[int], tuple], announce: Callable[[str], None],
                  stopped: threading.Event, final: tuple[str, ...] = ("timed out",)) -> tuple:
    """Run attempt(0), attempt(1), ... while one fails and restarts are left (spec.max_restarts),
    unless the job was stopped or the error starts with one of `final` (a restart cannot help).
    `announce` tells every rank's log about a restart. Returns the last attempt's (state, error, codes)."""
    n, causes = 0, []
    while True:
        state, error, codes = attempt(n)
        if state == "failed" and n < job.spec.max_restarts and not stopped.is_set() \
                and error and not error.startswith(final):
            n += 1
            count_restart(job, n, job.spec.max_restarts, error, causes, announce)
            continue
        return state, error, codes


def count_restart(job, n: int, of: int, error: str, causes: list, announce: Callable[[str], None]) -> None:
    """Restart `n` of `of` (--max-restarts) after `error`: in the job's status and every rank's log."""
    announce(f"[sdp_jupyter] restart {n} of {of} after: {(error or '').splitlines()[0]}\n")
    causes.append(error)
    job.update_status(restarts=n, restart_errors=causes)


def lost_a_peer(tail: str) -> tuple[bool, int | None]:
    """Whether a failed rank's last lines end with a collective that failed because of a peer, and the
    peer's rank where the error names one."""
    last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
    m = _LOST_A_PEER.search(last)
    if m is None:
        return False, None
    return True, int(m.group(1)) if m.group(1) else None


def first_cause(failed: list[int], tails: dict[int, str]) -> int:
    """Of the ranks that failed (in the order their exits arrived), the one to name as the cause: the
    first whose error is its own (not a collective that lost a peer); else the first failed peer the
    others' errors name; else the first to exit."""
    blamed = []
    for rank in failed:
        lost, peer = lost_a_peer(tails.get(rank, ""))
        if not lost:
            return rank
        if peer is not None:
            blamed.append(peer)
    return next((peer for peer in blamed if peer in failed), failed[0])


GROUP_LINES = 200  # lines of each failed rank's log read to find its last traceback (grouping by cause)


def job_error(job, failed: list[int], codes: list, who: Callable[[int], str], host: Callable[[int], str]) -> str:
    """The job's error for ranks that failed, on every target: the cause (`first_cause`, recorded in
    status.json for the flight recorder), its exit and last lines, then the others. Ranks that raised
    the same error as the cause themselves are named with it in a first line ("ranks 1-3 raised
    ValueError: ...", one traceback); a rank is said to have lost a peer only when its own last line
    says so. The groups go to status.json (`failure_groups`, what %sdp_jobs shows). `who(rank)` names
    a rank the target's way; `host(rank)` is the host it ran on."""
    tails = {r: job.logs(r, tail=GROUP_LINES) for r in failed}
    cause = first_cause(failed, tails)
    groups, lost = failure_groups(cause, failed, tails, codes)
    job.update_status(first_failure={"rank": cause, "code": codes[cause], "host": host(cause)},
                      failure_groups=[g.to_dict() for g in groups]
                      + ([{"ranks": lost, "error": "", "kind": "lost a peer"}] if lost else []))
    message = rank_report.failure_message(job, cause, who(cause), codes[cause])
    if len(groups[0].ranks) > 1:
        message = f"{groups[0].headline()}, each itself; the first to end:\n{message}"
    return message + others_failed(groups[1:], lost)


def failure_groups(cause: int, failed: list[int], tails: dict[int, str], codes: list) -> tuple[list, list]:
    """The failed ranks as (groups of ranks that failed by their own error, the cause's group first;
    the ranks whose collectives lost a peer). A rank killed by a signal is grouped by the signal."""
    lost = sorted(r for r in failed if r != cause and lost_a_peer(tails.get(r, ""))[0])
    own = [cause] + [r for r in failed if r != cause and r not in lost]
    code = lambda r: codes[r] if r < len(codes) and codes[r] is not None else 1  # noqa: E731
    kinds = {r: jobdir.describe_exit(code(r)) for r in own if code(r) < 0}
    texts = {r: "" if r in kinds else tails.get(r, "") for r in own}
    return rank_groups.group_failures(texts, kinds), lost


def others_failed(groups: list, lost: list[int]) -> str:
    """The lines the job's error adds for the ranks that failed besides the cause's group ('' when none
    did): each other error once with its ranks, then the ranks that failed because the cause went away."""
    out = "".join(f"\n(also {g.headline()}: {'its own error' if len(g.ranks) == 1 else 'each its own'}. "
                  f"{'Its log is' if len(g.ranks) == 1 else 'Their logs are'} in the job's logs/.)" for g in groups)
    if lost:
        one = len(lost) == 1
        out += (f"\n({rank_groups.label(lost)} failed too, after it: {'its' if one else 'their'} collectives "
                f"lost a peer. {'Its log is' if one else 'Their logs are'} in the job's logs/.)")
    return out


@atexit.register
def _stop_all_at_exit() -> None:
    with _LOCK:
        runs = list(_ACTIVE)
    for run in runs:
        run.kill_now()
        try:
            run.job.update_status(state="stopped", error="the launching process exited", ended=time.time())
        except OSError:
            pass
