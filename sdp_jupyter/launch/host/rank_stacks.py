"""The agent's half of Job.stacks(): signal this node's ranks and read back what each one's faulthandler
wrote into its stacks file (launch/rank/stack_signal.py). One answer for the launcher: `{"dumps": {rank: text},
"errors": {rank: why}}`, each text the file's header line and the new dump.

Only a rank whose handler is in place is signalled (SIGNAL's default action would kill it): its file's
header names its pid, and /proc says it catches SIGNAL. Only the rank's own pid, never its process group
(DataLoader workers). A dump is complete once the file has grown and then stayed the same for SETTLE_S
(faulthandler writes a whole dump inside its signal handler, in microseconds; there is no end mark).
"""
from __future__ import annotations

import json
import os
import time

from sdp_jupyter import jobdir
from sdp_jupyter.launch.rank.stack_signal import HEADER, SIGNAL

SETTLE_S = 0.05


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux: /proc/PID/status SigCgt); True where there is no
    /proc to ask (the file's header already says the rank armed it)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except FileNotFoundError:
        return not os.path.isdir("/proc/self")
    except (OSError, ValueError):
        return False
    return False


def _header(path) -> str | None:
    try:
        with open(path, "rb") as f:
            line = f.readline(1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    return line if line.startswith(HEADER) and line.endswith("\n") else None


def collect(procs: dict, job_dir, wait: float) -> dict:
    """`procs` {rank: process (a Popen or a warm rank)}: each live, armed rank signalled at once, then its
    new dump read, waiting at most `wait` seconds in all."""
    dumps, errors, asked = {}, {}, {}
    for rank, proc in procs.items():
        path = jobdir.stacks_path(job_dir, rank)
        head = _header(path)
        if proc is None or proc.poll() is not None:
            errors[rank] = "its process has ended"
        elif head is None or json.loads(head[len(HEADER):]).get("pid") != proc.pid or not catches(proc.pid, SIGNAL):
            errors[rank] = "it is still starting (no stack handler yet); ask again in a moment"
        else:
            size = path.stat().st_size
            try:
                os.kill(proc.pid, SIGNAL)
            except ProcessLookupError:
                errors[rank] = "its process has ended"
                continue
            asked[rank] = (path, head, size)
    deadline, seen = time.monotonic() + wait, {}
    while asked and time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        for rank, (path, head, size) in list(asked.items()):
            now = path.stat().st_size
            if now > size and seen.get(rank) == now:  # grown, and still since the last look: complete
                with open(path, "rb") as f:
                    f.seek(size)
                    dumps[rank] = head + f.read(now - size).decode("utf-8", "replace")
                del asked[rank]
            seen[rank] = now
    for rank in asked:
        errors[rank] = f"it wrote no stack within {wait:g} s of the signal"
    return {"dumps": dumps, "errors": errors}
