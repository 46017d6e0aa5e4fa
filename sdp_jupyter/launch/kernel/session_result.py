"""A session cell's answers (`CellResult`) and the session's error (`SessionError`), apart from the
session itself (launch/kernel/session.py) so that the modules mixed into it (session_calls.py,
session_debug.py) can use them without importing the session back."""
from __future__ import annotations

from dataclasses import dataclass, field

from sdp_jupyter.launch.kernel.job import JobError

POLL = 0.02  # seconds at most between looks at the job and the output stream; an answer wakes the wait at once


class SessionError(JobError):
    """A cell failed (on the ranks named), or the session cannot do what was asked."""


@dataclass
class CellResult:
    """One cell's answers. `answers[rank]`: that rank's {ok, error, interrupted, seconds, rss, ...}."""

    n: int
    ranks: list
    answers: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    causes: list = field(default_factory=list)  # the ranks that failed before the others were given up on

    @property
    def failed(self) -> list:
        return [r for r in self.ranks if not self.answers.get(r, {}).get("ok", False)]

    @property
    def printed(self) -> bool:
        """Whether any rank wrote to its stdout or stderr in this cell (a rank that did not say: yes)."""
        return any(a.get("printed", 1) for a in self.answers.values()) or len(self.answers) < len(self.ranks)

    @property
    def interrupted(self) -> list:
        return [r for r in self.ranks if self.answers.get(r, {}).get("interrupted")]

    def value(self, rank: int):
        import pickle

        answer = self.answers.get(rank, {})
        if answer.get("value_error"):
            raise SessionError(f"rank {rank}'s value: {answer['value_error']}")
        data = answer.get("value")
        return None if data is None else pickle.loads(data)

    def message(self) -> str:
        """What went wrong, ranks that failed the same way together (rank_groups.group_failures): the
        cause's traceback once, in full ("ranks 1-3 failed:"), every other error's last line."""
        if not self.failed:
            return ""
        from sdp_jupyter.launch.kernel.rank_groups import failure_lines, group_failures, label

        # the cause first: a rank that raised, before those interrupted or failed because of it
        # (a rank that died before anything else)
        order = sorted(self.failed, key=lambda r: (not self.answers.get(r, {}).get("died"), r not in self.causes,
                                                   r not in self.answers,
                                                   bool(self.answers.get(r, {}).get("interrupted")), r))
        got = {r: self.answers[r] for r in order if r in self.answers}
        lines = failure_lines(group_failures({r: a.get("error") or "" for r, a in got.items()}, {
            r: "died" if a.get("died") else "interrupted" if a.get("interrupted") else "failed" for r, a in got.items()}))
        if len(got) < len(order):
            lines.append(f"{label(set(order) - set(got))}: no answer (still running when the cell was given up)")
        died = [r for r in self.failed if self.answers.get(r, {}).get("died")]
        others = [r for r in self.failed if r not in died]
        head = (f"{label(died)} died during the cell"
                + (f"; it failed on {label(others)}" if others else "") if died else
                f"the cell was interrupted on {label(self.interrupted)}" if
                self.interrupted and len(self.interrupted) == len(self.failed) else
                f"the cell failed on {label(self.failed)}")
        return "\n".join([head] + lines + self.notes + ["The session is still up."])
