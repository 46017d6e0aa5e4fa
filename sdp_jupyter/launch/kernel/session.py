"""Interactive sessions: ranks that keep their process group and their variables from cell to cell.

`Session.start(spec)` launches a job like any other (every target whose ranks an agent or this
kernel starts: local, SSH, Ray, Slurm) whose script is the rank's cell loop (launch/rank/cell_loop.py); the
job's view, logs, dashboard, Stop and the end-with-the-kernel rule are a job's. `session.run(code)`
hands a cell to the ranks and waits for every rank's answer; `%%sdp_px` is that call in a cell. Cells
and answers travel as frames over the agents' channels (launch/host/session_relay.py), not files.

A cell that raised or was interrupted somewhere can leave a collective half done: ranks that
finished wait forever for the ones that left. So after a failed cell the session compares what the
ranks' groups have issued and, when it differs or a rank is still inside the cell, interrupts the
ranks still running and reconnects the process group on every rank (launch/rank/cell_loop.py says what
that keeps). The session stays up. On smddp a rank that dies is started again by its node's agent:
it joins the group the others reconnect, with an empty namespace, and the cell's error says what it
lost. On another backend (a gloo collective can wait on a dead peer until
its timeout), a death ends the session (the job fails, naming the rank).

A host gone for good (its agent's link ended or went silent) takes its ranks and their variables; the
cell's error says so, and the session waits for a choice: `shrink()` (`%sdp_session shrink`) makes the
process group again of the ranks left, which keep their variables and their session numbers, or `stop()`.
Node 0's host holds the session's store: without it the session ends.
"""
from __future__ import annotations

import queue
import time

from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.kernel.session_calls import SessionCalls
from sdp_jupyter.launch.kernel.session_debug import SessionDebug
from sdp_jupyter.launch.kernel.session_mend import SessionMending, ranks_text
from sdp_jupyter.launch.kernel.session_result import POLL, CellResult, SessionError
from sdp_jupyter.launch import targets
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.rank.cell_loop import SCRIPT
from sdp_jupyter.launch.spec import JobSpec

TARGETS = targets.having("sessions")  # where this kernel or an agent starts the ranks
FAILED_GRACE = 1.0     # seconds the other ranks get to finish a cell one rank failed, before they are interrupted
INTERRUPT_GRACE = 0.5  # seconds interrupted ranks get to answer; still missing: inside a collective (reconnected)


class Session(SessionCalls, SessionDebug, SessionMending):
    """A live interactive session over one job. Made by `Session.start`; `run` a cell, `stop` it."""

    def __init__(self, job: Job):
        self.job = job
        self._mail = job.supervisor.session_mail  # the ranks' answers, as the agents sent them
        self._answers: dict[tuple, dict] = {}  # (cell, rank) -> an answer that came, until read
        self._readies: dict[int, dict] = {}  # rank -> its ready record, until read
        self.n = 0
        self.last: CellResult | None = None
        self.ready: dict[int, dict] = {}
        self.generation = 0  # the process group's rendezvous generation: one more per reconnect
        self.replacements: list[dict] = []  # {rank, cell, why, pid}: ranks that died and were started again
        self.members = list(range(job.world_size))  # the ranks cells run on; fewer after shrink()
        self.stranded: dict[int, str] = {}  # rank -> why: lost with their host, until shrink()
        self.left: dict[int, str] = {}  # rank -> why: left the session by shrink()
        self._pending: list[int] = []  # ranks that died on a live host while others were stranded

    # ------------------------------------------------------------------ life
    @classmethod
    def start(cls, spec: JobSpec, push: dict | None = None, wait: float = 300.0) -> "Session":
        """Launch the session's ranks and wait until each has its process group."""
        from sdp_jupyter.launch.kernel import api

        if spec.target not in TARGETS:
            raise SpecError("--target", f"a session needs ranks that stay up between cells and a channel to "
                                        f"them; {spec.target} runs a batch job (SageMaker training jobs run a "
                                        f"script to its end). Fix: --target {' / '.join(TARGETS)}, or run the "
                                        "cell as a job with %%sdp_train")
        if spec.heal:
            raise SpecError("--heal", "is for training jobs (%%sdp_train); a session already replaces a rank "
                                      "that dies and keeps the others' variables (docs/session.md). Fix: remove --heal")
        if spec.max_restarts:
            raise SpecError("--max-restarts", "restarting every rank would empty every namespace, so a session "
                                              "never restarts its ranks: on smddp a rank that dies is started "
                                              "again alone (docs/session.md). Fix: leave --max-restarts out")
        if spec.elastic:
            raise SpecError("--nodes", f"MIN:MAX re-forms a job from its checkpoint; a session keeps its "
                                       f"ranks' variables in memory, so its nodes are fixed (a dead rank is "
                                       f"replaced on smddp). Fix: --nodes {spec.nodes}")
        if spec.script is not None or spec.result:
            raise SpecError("--result" if spec.result else "script",
                            "a session runs the cells you give it: use %%sdp_px --result NAME per cell")
        # smddp's collectives fail at once when a peer dies, and its engine reconnects in place: a dead
        # rank can be replaced (its store then runs in a process of its own, so rank 0 can be too).
        # gloo's may wait on the dead peer until its timeout: a death ends the session
        replace = spec.backend == "smddp"
        # SDP_SESSION_CHANNEL: the agents give the ranks a connection for cells (launch/host/session_relay.py)
        env = {**spec.env, "SDP_SESSION_CHANNEL": "1", **({"SDP_SESSION_STORE": "1"} if replace else {})}
        spec = spec.replace(code=SCRIPT, init_process_group=False, env=env)
        job = api.launch(spec, push=push)
        job.update_status(session=True)
        session = cls(job)
        job.supervisor.open_session(replace=replace)
        try:
            session._wait_ready(wait)
        except BaseException:
            session.stop()
            raise
        return session

    def _wait_ready(self, wait: float) -> None:
        deadline = time.monotonic() + wait
        world = self.job.world_size
        while len(self.ready) < world:
            self.ready.update(self._readies)
            self._readies.clear()
            if len(self.ready) == world:
                return
            self._check_alive()
            lost = self.job.supervisor.lost_ranks()
            if lost:
                rank = min(lost)
                raise SessionError(f"session {self.job.name}: rank {rank} ended before it had its process group: "
                                   f"{lost[rank]}", self.job)
            if time.monotonic() > deadline:
                missing = sorted(set(range(world)) - set(self.ready))
                raise SessionError(f"session {self.job.name}: rank(s) {missing} did not make their process group "
                                   f"within {wait:g} s; see %sdp_logs {self.job.name} --rank {missing[0]}", self.job)
            self._pump(POLL)

    @property
    def alive(self) -> bool:
        """True until the session's job ended (stopped, or failed)."""
        return not self.job.done

    def _check_alive(self) -> None:
        if self.job.done:
            why = self.job.error or f"the job is {self.job.state}"
            raise SessionError(f"session {self.job.name} has ended: {why}", self.job)

    def stop(self, grace: float = 5.0) -> str:
        """Ask every rank to leave its loop (the process group closed cleanly), then stop what remains."""
        if not self.job.done:
            self._put({"kind": "stop"})
            self.job.wait(grace)
        if not self.job.done:
            self.job.stop()
        return self.job.state

    def status(self) -> dict:
        """Ranks alive, each rank's memory (from its last answer) and the last cell."""
        rss = {r: info.get("rss", 0) for r, info in self.ready.items()}
        if self.last is not None:
            for r, a in self.last.answers.items():
                rss[r] = a.get("rss", rss.get(r, 0))
        return {"name": self.job.name, "state": self.job.state, "alive": self.alive, "world_size": self.job.world_size,
                "members": list(self.members), "stranded": dict(self.stranded), "left": dict(self.left),
                "hosts": {r: info.get("host") for r, info in self.ready.items()}, "rss": rss,
                "cells": self.n, "generation": self.generation, "replacements": list(self.replacements),
                "last_cell": None if self.last is None else {
                    "n": self.last.n, "ranks": self.last.ranks, "failed": self.last.failed,
                    "seconds": round(self.last.seconds, 4)}}

    # ------------------------------------------------------------------ cells
    def _put(self, cell: dict) -> int:
        import pickle

        n = self.n
        self.n += 1
        self.job.supervisor.send_cell(n, pickle.dumps({**cell, "n": n}, protocol=pickle.HIGHEST_PROTOCOL))
        return n

    def _pump(self, timeout: float) -> None:
        """Wait up to `timeout` for the ranks' next answer, then take every one that came."""
        import pickle

        try:
            item = self._mail.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            kind, n, rank, data = item
            if kind == "ready":
                self._readies[rank] = pickle.loads(data)
            else:
                self._answers[(n, rank)] = pickle.loads(data)
            try:
                item = self._mail.get_nowait()
            except queue.Empty:
                return

    def run(self, code: str, ranks: list | None = None, want: str = "none", push_names: list | None = None,
            values: dict | None = None, on_wait=None, label: str | None = None) -> CellResult:
        """Run `code` on `ranks` (default: every rank); `want`: "result" (rank 0's last expression; the
        first listed rank's with --ranks), "gather" (every rank's), or "none"; `label`: the cell's name in
        tracebacks (the notebook's In[N]; default the session's own count). Raises SessionError when
        the session has ended; a cell that failed returns a result whose `failed` is not empty.
        KeyboardInterrupt while waiting interrupts the cell on every rank, then re-raises."""
        self._check_alive()
        if self.stranded:
            raise SessionError(f"session {self.job.name}: {self._stranded_text()}", self.job)
        if ranks is not None:
            bad = [r for r in ranks if r not in self.members]
            if bad:
                raise SpecError("--ranks", f"rank {bad[0]} is not in this session (ranks {ranks_text(self.members)})")
            ranks = sorted(set(ranks))
        push = pickle_push(push_names or [], values or {})  # pickled once, unpickled once on each rank
        n = self._put({"kind": "run", "code": code, "ranks": ranks, "want": want, "label": label, "push": push})
        result = CellResult(n, list(self.members) if ranks is None else ranks)
        started = time.monotonic()
        try:
            self._collect(result, on_wait)
        except KeyboardInterrupt:
            self.interrupt(result)
            result.seconds = time.monotonic() - started
            self.last = result
            raise
        result.seconds = time.monotonic() - started
        if result.failed:
            self._mend(result)
        self.last = result
        return result

    def _collect(self, result: CellResult, on_wait=None, give_up: float | None = None) -> None:
        """Wait for every rank's answer (ranks outside --ranks answer at once). When a rank failed and
        others are still in the cell FAILED_GRACE later, stop waiting: they are likely inside a
        collective the failed rank never joined, and _mend's reconnect ends it with an error that names
        that rank. `give_up`: seconds after which the ones missing stay missing."""
        failed_at = None
        started = time.monotonic()
        while True:
            for rank in self._read_answers(result, on_wait) + self._read_deaths(result):
                if not result.answers[rank].get("ok"):
                    result.causes.append(rank)
                    failed_at = failed_at or time.monotonic()
            if set(self.members) <= set(result.answers):
                return
            now = time.monotonic()
            if failed_at is not None and now - failed_at > FAILED_GRACE:
                return
            if give_up is not None and now - started > give_up:
                return
            if self.job.done:
                self._check_alive()
            if on_wait is not None:
                on_wait()
            self._pump(POLL)

    def _read_answers(self, result: CellResult, on_wait=None) -> list:
        """Load the answers to `result`'s cell that arrived since the last look; the ranks that answered."""
        new = []
        for rank in self.members:
            if rank not in result.answers and (result.n, rank) in self._answers:
                answer = self._answers.pop((result.n, rank))
                if "debugging" in answer:  # a breakpoint() stopped the cell there: its pdb served here
                    self.serve_breakpoint(rank, answer["debugging"], on_wait)
                    continue
                result.answers[rank] = answer
                new.append(rank)
        return new

    def _read_deaths(self, result: CellResult) -> list:
        """The ranks that died without answering `result`'s cell (their supervisor starts them again
        when _mend asks): each gets an answer that says so."""
        new = []
        for rank, why in sorted(self.job.supervisor.lost_ranks().items()):
            if rank in self.members and rank not in result.answers:
                result.answers[rank] = {"ok": False, "died": True, "error": why}
                new.append(rank)
        return new

    def interrupt(self, result: CellResult) -> None:
        """Ctrl-C: a KeyboardInterrupt in the cell on every rank, then the group made whole if needed."""
        self.job.supervisor.interrupt_ranks()
        self._collect(result, give_up=INTERRUPT_GRACE)
        self._mend(result)

    def stacks(self, ranks: list | None = None, wait: float = 5.0):
        """Every rank's Python stack now, equal ones grouped (Job.stacks(); %sdp_stacks): where a cell is."""
        return self.job.stacks(ranks, wait)


def describe(status: dict) -> str:
    """Session.status() as the lines %sdp_session status prints."""
    s, last = status, status["last_cell"]
    members = len(s.get("members", range(s["world_size"])))
    ranks = f"{s['world_size']} ranks" if members == s["world_size"] else f"{members} of {s['world_size']} ranks"
    lines = [f"session {s['name']}: {s['state']}, {ranks}, {s['cells']} cell(s) run"]
    for rank in range(s["world_size"]):
        rss = s["rss"].get(rank, 0) / 2 ** 20
        where = f"on {s['hosts'].get(rank, '?')}"
        if rank in s.get("left", {}):
            lines.append(f"  rank {rank}: left the session ({where}): {s['left'][rank].splitlines()[0]}")
        elif rank in s.get("stranded", {}):
            lines.append(f"  rank {rank}: lost with its host ({where}); %sdp_session shrink goes on without it")
        else:
            lines.append(f"  rank {rank}: {where}, {rss:.0f} MiB resident")
    if last is not None:
        failed = f", failed on {last['failed']}" if last["failed"] else ""
        lines.append(f"  last cell: {last['n']} on ranks {last['ranks']}, {last['seconds']:.3f} s{failed}")
    for r in s.get("replacements", []):
        lines.append(f"  rank {r['rank']} started again in cell {r['cell']} (pid {r['pid']}) after: {r['why']}")
    return "\n".join(lines)


_CURRENT: Session | None = None  # this kernel's session (%sdp_session, %%sdp_px)


def current() -> Session | None:
    """This kernel's live session, else None."""
    return _CURRENT if _CURRENT is not None and _CURRENT.alive else None


def start(spec: JobSpec, push: dict | None = None, as_current: bool = True) -> Session:
    """Start a session; `as_current`: as this kernel's session (one at a time: %%sdp_px needs to know
    where its cells go)."""
    global _CURRENT
    if not as_current:
        return Session.start(spec, push=push)
    live = current()
    if live is not None:
        raise SpecError("%sdp_session", f"session {live.job.name} is already running; "
                                        "%sdp_session stop ends it first")
    _CURRENT = Session.start(spec, push=push)
    return _CURRENT


def session(push: dict | None = None, **fields):
    """`sdp_jupyter.session(nodes=2, backend="gloo", ...)`: start an interactive session and return it.

    Takes every keyword `sdp_jupyter.launch` takes (nodes, procs_per_node, backend, target, hosts,
    address, env, ...; `push={"X": X}` sends values first). It becomes this kernel's session (the one
    `%%sdp_px` runs cells on) unless one is already running. Use it in a `with` block, or call
    `stop()`; it also ends with the kernel."""
    from sdp_jupyter.launch.kernel import api

    spec = JobSpec(code="pass", **api.target_keywords(fields))
    if push and not spec.push:
        spec = spec.replace(push=list(push))
    return start(spec, push=push, as_current=current() is None)
