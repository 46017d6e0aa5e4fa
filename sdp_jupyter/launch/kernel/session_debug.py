"""A post-mortem debugger on one rank of a session (`%sdp_debug RANK`, `Session.debug`): pdb on that
rank's traceback of the last cell that failed there, driven from the notebook.

The exchange is one session cell per round trip (kind "debug", for one rank; launch/rank/postmortem.py
drives pdb there): the cell carries pdb's next input lines, the rank's answer pdb's output up to its
next prompt, and whether pdb is still open. The other ranks answer such a cell at once without running
anything, and wait for the next one as after any cell: nothing of the session changes, no collective is
issued, so no reconnect follows. Answers come in cell order like every cell's, so the channel, the
agents' relays and the mending after a death need nothing new.

Two forms: `commands` (as `python -m pdb -c`) go in one cell and pdb quits after them (`q` is added
when they do not end it), the transcript returned; without them, `ask` (input(): in a notebook the
frontend's input box, as `%debug`'s) reads each line and `show` prints pdb's output, until pdb ends.
Ctrl-C while a command runs interrupts that command on the rank (pdb prompts again); Ctrl-C at the
prompt ends pdb.
"""
from __future__ import annotations

PROMPT = "(Pdb) "
WAIT = 0.02  # seconds at most between looks at the job while a breakpoint's line is out


def _converse(report: dict, send, ask, show, eof: str) -> None:
    """pdb's output shown and a line asked for, until pdb is no longer open: `send(line)` gives the
    next report. End of input (or no input at all) sends `eof`; Ctrl-C sends `q` and re-raises."""
    while report.get("open"):
        text = report.get("output", "")
        prompt = text.rpartition("\n")[2]  # what asks for the line: pdb's, or `interact`'s ">>> "
        if text[:len(text) - len(prompt)].strip():
            show(text[:len(text) - len(prompt)].rstrip("\n"))
        try:
            line = ask(prompt or PROMPT)
        except (EOFError, NotImplementedError):  # no one to type: stdin closed, a frontend without input
            line = eof  # (ipykernel's StdinNotImplementedError, e.g. a notebook run by nbclient)
        except KeyboardInterrupt:
            send("q")
            raise
        report = send(line)
    if report.get("output", "").strip():
        show(report["output"].rstrip("\n"))


class SessionDebug:
    """Mixed into Session (launch/kernel/session.py), whose cells and answers it uses."""

    def debug(self, rank: int, commands: list | None = None, *, ask=None, show=None, on_wait=None) -> str:
        """Post-mortem pdb on `rank`'s last failed cell. `commands`: pdb commands run in order, then `q`;
        returns pdb's output (each command echoed after its prompt). None: interactive, each line from
        `ask(prompt)`, the output to `show(text)`; returns "". Raises SessionError when the rank has no
        failed cell, is not in the session, or the session has ended."""
        import builtins

        from sdp_jupyter.launch.kernel.session_result import SessionError

        # looked up now: ipykernel puts its input() (the frontend's input box) in builtins per execution
        ask, show = ask or builtins.input, show or builtins.print
        self._check_alive()
        if rank not in self.members:
            raise SessionError(f"%sdp_debug {rank}: rank {rank} is not in session {self.job.name} "
                               f"(ranks {', '.join(map(str, self.members))})", self.job)
        if self.stranded:
            raise SessionError(f"session {self.job.name}: {self._stranded_text()}", self.job)
        if commands is not None:
            answer = self._debug_cell(rank, list(commands), echo=True, last=True, on_wait=on_wait)
            unused = answer.get("unused") or []
            left = (f"\npdb ended before these commands: {'; '.join(unused)} (a command such as `c` or `n` "
                    "ends a post-mortem)" if unused else "")
            return answer.get("output", "") + left
        answer = self._debug_cell(rank, [], echo=False, last=False, on_wait=on_wait)
        show(f"post-mortem of cell {answer.get('cell')} on rank {rank} (the other ranks wait; q ends it)")
        _converse(answer, lambda line: self._debug_cell(rank, [line], echo=False, last=False, on_wait=on_wait),
                  ask, show, eof="q")
        return ""

    def serve_breakpoint(self, rank: int, report: dict, on_wait=None) -> None:
        """A breakpoint() stopped the running cell on `rank` (its answer to the cell said "debugging"):
        pdb there, line by line from input() (the frontend's input box), until it lets the cell go on
        (`c`; `n`/`s` stop again and come back here) or quits (`q`: the cell fails there with BdbQuit).
        End of input (no frontend) is `c`; Ctrl-C quits pdb and then interrupts the cell everywhere."""
        import builtins

        if on_wait is not None:
            on_wait()  # what the ranks printed before the breakpoint, first
        builtins.print(f"breakpoint() on rank {rank} in cell {report.get('cell')}: c goes on, q ends the cell "
                       f"(the other ranks go on until they need rank {rank})")
        _converse(report, lambda line: self._breakpoint_line(rank, line, on_wait), builtins.input, builtins.print,
                  eof="c")

    def _breakpoint_line(self, rank: int, line: str, on_wait) -> dict:
        """One line to the pdb of `rank`'s breakpoint (a "debug" cell the other ranks skip: some are still
        in the cell); its answer (output, open)."""
        n = self._put({"kind": "debug", "rank": rank, "lines": [line], "live": True})
        while (n, rank) not in self._answers:
            self._check_alive()
            if rank in self.job.supervisor.lost_ranks():  # the cell's wait reads the death
                return {"open": False, "output": ""}
            if on_wait is not None:
                on_wait()
            self._pump(WAIT)
        return self._answers.pop((n, rank)).get("debug") or {}

    def _debug_cell(self, rank: int, lines: list, echo: bool, last: bool, on_wait=None) -> dict:
        """One debug cell to `rank` with pdb's next `lines`; that rank's answer (output, open, cell).
        `last`: pdb quits once these lines are read. The session's last cell stays the failed one."""
        from sdp_jupyter.launch.kernel.session_result import CellResult, SessionError

        n = self._put({"kind": "debug", "rank": rank, "lines": lines, "echo": echo, "last": last})
        result = CellResult(n, list(self.members))
        try:
            self._collect(result, on_wait)
        except KeyboardInterrupt:  # inside a command: the rank's pdb catches it and prompts again
            self.interrupt(result)
            if not last and result.answers.get(rank, {}).get("debug", {}).get("open"):
                self._debug_cell(rank, ["q"], echo=False, last=True, on_wait=on_wait)
            raise
        if result.failed:  # a rank died (a statement in pdb may end its process): mended as after any cell
            self._mend(result)
            raise SessionError(result.message(), self.job)
        debug = result.answers[rank].get("debug") or {}
        if debug.get("error"):
            failed = {r: a["failed_cell"] for r, a in sorted(result.answers.items()) if a.get("failed_cell")}
            hint = ("; " + ", ".join(f"rank {r} has one (cell {label})" for r, label in failed.items())
                    + f": %sdp_debug {min(failed)}" if failed else "")
            raise SessionError(f"%sdp_debug {rank}: {debug['error']}{hint}", self.job)
        return debug
