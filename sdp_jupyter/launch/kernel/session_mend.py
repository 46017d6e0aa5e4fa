"""How a session mends itself after a failed cell (mixed into Session, launch/kernel/session.py): the
process group reconnected when a cell left a collective half done or a rank died, the dead ranks started
again and told what they lost, and, for ranks lost with their host, the choice `shrink()` offers (the
group made again of the ranks left, which keep their variables).
"""
from __future__ import annotations

import time

from sdp_jupyter.launch.kernel.session_result import POLL, CellResult, SessionError


def ranks_text(ranks: list) -> str:
    """Ranks as a sentence lists them: "0, 2, 3"."""
    return ", ".join(map(str, ranks))


class SessionMending:
    """Session's recovery; needs the Session's job, members, generation, n, ready, replacements, stranded,
    _pending, left, last, and its _put, _pump, _read_answers, _read_deaths and _check_alive."""

    def _mend(self, result: CellResult) -> None:
        """After a failed cell: reconnect the process group when a rank is missing or the ranks'
        groups issued different numbers of collectives (a collective left half done)."""
        answers = result.answers
        missing = [r for r in self.members if r not in answers]
        counts = {repr(a.get("counts")) for a in answers.values()}
        died = sorted(r for r, a in answers.items() if a.get("died"))
        gone = self.job.supervisor.gone_ranks()
        if any(r in gone for r in died):  # no host to start them on: the user chooses (shrink or stop)
            self.stranded = {r: gone[r] for r in died if r in gone}
            self._pending = [r for r in died if r not in gone]
            result.notes.append(self._stranded_text())
            return
        if not died and not missing and len(counts) == 1 and "{}" not in counts:
            result.notes.append("every rank issued the same collectives: the process group is intact")
            return
        why = (f"rank(s) {died} died" if died else f"rank(s) {missing} were still inside the cell" if missing else
               "the ranks issued different numbers of collectives, so one was left half done")
        self.generation += 1
        rec = self._remake({"kind": "reconnect", "generation": self.generation, "replaced": died}, died, result, why)
        survivor = next(r for r in self.members if r not in died)
        result.notes.append(f"process group reconnected ({why}): {rec.answers[survivor].get('note')}")
        self._replaced(died, result, rec, survivor, result.notes)

    def _remake(self, cell: dict, died: list, result: CellResult, why: str, longer: float = 0.0) -> CellResult:
        """Send `cell` (reconnect or shrink) after `result`'s failed cell, with the ranks in `died` started
        again to join it; wait (60 s, 120 s with replacements, plus `longer`) until every member answered
        both. Raises SessionError when the group cannot be made again."""
        n = self.n
        for rank in died:  # started again now: each joins the group the others make again in cell n
            self.job.supervisor.replace_rank(rank, f"{self.generation}:{n}:{','.join(map(str, self.members))}")
        self._put(cell)
        rec = CellResult(n, list(self.members))
        wait = 60 + (60 if died else 0) + longer  # a replacement starts its interpreter and torch first
        deadline_result = time.monotonic() + wait
        # the stuck ranks answer the failed cell first (their collective fails once the others reconnect)
        while not set(self.members) <= set(result.answers) or not set(self.members) <= set(rec.answers):
            self._check_alive()
            self._read_answers(result)
            self._read_answers(rec)
            if self._read_deaths(rec) or time.monotonic() > deadline_result:
                lost = {r: w for r, w in self.job.supervisor.lost_ranks().items() if r in self.members}
                more = f"; rank {min(lost)} died again: {lost[min(lost)]}" if lost else ""
                raise SessionError(f"session {self.job.name}: the process group could not be made again within "
                                   f"{wait} s ({why}){more}; stop the session (%sdp_session stop) and start a "
                                   "new one", self.job)
            self._pump(POLL)
        broken = [r for r, a in rec.answers.items() if not a.get("ok")]
        if broken:
            raise SessionError(f"session {self.job.name}: rank {broken[0]}: {rec.answers[broken[0]].get('error')}; "
                               "stop the session (%sdp_session stop) and start a new one", self.job)
        return rec

    def _replaced(self, died: list, result: CellResult, rec: CellResult, survivor: int, notes: list) -> None:
        """Record the ranks in `died` (in `result`, the cell they died in), started again and joined in
        `rec`; a note for each in `notes`."""
        answers = result.answers
        for rank in died:
            joined = rec.answers[rank]
            self.ready[rank] = {**self.ready.get(rank, {}), "pid": joined.get("pid"), "host": joined.get("host")}
            self.replacements.append({"rank": rank, "cell": result.n, "why": answers[rank]["error"].splitlines()[0],
                                      "pid": joined.get("pid"), "at": time.time()})
            notes.append(
                f"rank {rank} was started again and joined the process group: every variable it had is gone "
                f"(the other ranks kept theirs). On it `sdp_replaced` is True: rebuild what it needs there "
                f"(%%sdp_px --ranks {rank}) and copy state from a live rank, e.g. "
                f"sdp_jupyter.checkpoint.broadcast_state(model, optimizer, src={survivor}) on every rank")
        if died:  # the job's status keeps the same record (the job view, a reopened job)
            self.job.update_status(replacements=list(self.replacements))

    # ---------------------------------------------------------------- a host gone for good
    def _stranded_text(self) -> str:
        lost = ", ".join(f"rank {r}: {why.splitlines()[0]}" for r, why in sorted(self.stranded.items()))
        left = [r for r in self.members if r not in self.stranded]
        return (f"rank(s) {ranks_text(sorted(self.stranded))} were lost with their host, and every variable they had "
                f"with them ({lost}). The other ranks kept theirs, but their process group still counts the lost "
                f"ones. `%sdp_session shrink` (Session.shrink()) goes on with the {len(left)} rank(s) left "
                f"({ranks_text(left)}); `%sdp_session stop` ends the session")

    def group_timeout(self) -> float:
        """The ranks' collective deadline (SDP_TIMEOUT as the session's --env sets it, else its default)."""
        from sdp_jupyter._env import VARIABLES, env_float

        default = float(VARIABLES["SDP_TIMEOUT"].default)
        try:
            return env_float("SDP_TIMEOUT", default, min=0.001, environ=self.job.spec.env)
        except ValueError:
            return default

    def still_inside(self) -> list:
        """The members that have not answered the last cell (inside a collective, or a long computation)."""
        return [] if self.last is None else [r for r in self.members if r not in self.last.answers]

    def shrink(self) -> CellResult:
        """Go on without the ranks lost with their host: every rank left makes the process group again of
        the ranks left (launch/rank/cell_loop.py: shrink), keeping its variables and its session number."""
        self._check_alive()
        if not self.stranded:
            raise SessionError(f"session {self.job.name}: no rank was lost with its host, so there is nothing to "
                               "shrink (a rank that died on a live host was started again)", self.job)
        lost, died = dict(self.stranded), list(self._pending)
        self.members = [r for r in self.members if r not in lost]
        if not self.members:
            raise SessionError(f"session {self.job.name}: no rank is left; %sdp_session stop", self.job)
        last = self.last  # the cell the host was lost in (stranded is set only after one)
        if not set(self.members) <= set(last.answers):  # some are still inside it
            self.job.supervisor.interrupt_ranks()
        self.job.supervisor.drop_ranks(list(lost))
        self.generation += 1
        why = f"rank(s) {ranks_text(sorted(lost))} lost with their host"
        # a rank inside a collective with a lost one whose link went silent (no error reaches it) leaves it
        # at the group's deadline, and reads the shrink only then
        rec = self._remake({"kind": "shrink", "generation": self.generation, "members": self.members}, died, last, why,
                           longer=self.group_timeout())
        self.stranded, self._pending = {}, []
        self.left.update(lost)
        rec.notes.append(f"{len(self.members)} rank(s) go on ({ranks_text(self.members)}): {rec.answers[self.members[0]].get('note')}")
        self._replaced(died, last, rec, self.members[0], rec.notes)
        self.job.update_status(session_members=list(self.members), session_left=dict(self.left))
        return rec
