"""A CPU limit on one test host (a cgroup v1 `cpu` controller, as this machine mounts it): every process
on the host moves into it, and what they start (an sshd's sessions, an agent's ranks) inherits it."""
from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

CPU_ROOT = Path("/sys/fs/cgroup/cpu")


def available() -> str | None:
    """Why a CPU limit cannot be made here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root"
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists() and not (CPU_ROOT / "cgroup.procs").exists():
        return f"no cgroup v1 cpu controller at {CPU_ROOT}"
    return None


@contextlib.contextmanager
def cpu_limited(pids_of, share: float):
    """While inside: the processes `pids_of()` returns (called again at the end, for late ones) run in a
    cgroup limited to `share` of one CPU; afterwards they go back to the root group and it is removed."""
    group = CPU_ROOT / f"sdp-test-slow-{secrets.token_hex(3)}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text(str(int(100000 * share)))
        for pid in pids_of():
            with contextlib.suppress(OSError):
                (group / "cgroup.procs").write_text(str(pid))
        yield group
    finally:
        for line in (group / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                (CPU_ROOT / "cgroup.procs").write_text(line)
        group.rmdir()
