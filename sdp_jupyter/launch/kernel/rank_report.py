"""What the kernel says of a rank: the job's error for a rank that ended badly (who, how, the collective a
crash was in, its log, its last lines) and what a view shows of its output (ViewCut). Read from the
job directory the agents fill, whatever the target."""
from __future__ import annotations

import re

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel import stacks


class ViewCut:
    """What a view shows of one rank's pieces: the first LINE_CAP bytes of a line, then a note (a 64 MiB
    line is never held whole, nor sent to the notebook); the log keeps every byte."""

    def __init__(self, cap: int = jobdir.LINE_CAP):
        self.cap, self.cut = cap, False

    def text(self, raw: bytes) -> str | None:
        """The view's text for this piece, or None while the rest of a cut line goes by."""
        if self.cut:
            if raw.endswith(b"\n"):
                self.cut = False
            return None
        text = raw.decode("utf-8", errors="replace")
        if not raw.endswith(b"\n") and len(raw) >= self.cap:
            self.cut = True
            text += f" … [line cut at {self.cap} bytes in this view; the log has it all]\n"
        return text


LAST_LINES = 12  # lines of a failed rank's output quoted in the job's error
_CRASH_LINES = 400  # how far back a crashed rank's log is read for its stacks

_FATAL = re.compile(r"\[sdp_jupyter\] fatal signal \d+ \(\w+\) in thread '(?P<thread>[^']*)'")


def crash_summary(log: str) -> str:
    """What a crashed rank's log says about the crash (bootstrap.arm_crash_report wrote it): the
    thread, whether the engine's code was on its native stack, and the collective running."""
    lines = log.splitlines()
    where = ""
    for i, line in enumerate(lines):
        m = _FATAL.search(line)
        if m:
            native = []
            for frame in lines[i + 1:]:
                if frame.startswith("Fatal Python error") or not frame.strip():
                    break
                native.append(frame)
            engine = any("_engine" in f for f in native[1:])  # [0] is the handler itself
            where = f" in thread '{m.group('thread')}'" + (" inside the smddp engine" if engine else "")
    # faulthandler lists the crashing thread's stack first, then the others': the first that ran a collective
    for thread in stacks.parse(log):
        call = stacks.collective(thread.frames)
        if call:
            return f"{where} during {call}"
    return where


def failure_message(job, rank: int, who: str, code: int) -> str:
    """The job's error for a rank that ended badly: who, how, what was running (for a signal) and
    where its log is, then its last lines."""
    msg = f"{who} {jobdir.describe_exit(code)}"
    if code < 0:
        msg += crash_summary(job.logs(rank, tail=_CRASH_LINES))
        msg += (f"; its log (Python stacks, native frames): {jobdir.log_path(job.dir, rank)}; "
                "`python -m sdp_jupyter.doctor` checks how this machine's engine was built")
    tail = job.logs(rank, tail=LAST_LINES).rstrip()
    return msg + (f"; its last lines:\n{tail}" if tail else "")
