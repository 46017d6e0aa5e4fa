"""The doctor's report: one Check per line (OK, WARN, FAIL or INFO, and for anything not OK the fix
in words), the Report that collects them (as text for people, as JSON for a script or the parent
process) and its one-line summary."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

OK, WARN, FAIL, INFO = "OK", "WARN", "FAIL", "INFO"
STATUSES = (OK, WARN, FAIL, INFO)


@dataclass
class Check:
    name: str  # what was checked ("/dev/shm")
    status: str  # OK / WARN / FAIL / INFO
    detail: str  # what was found
    fix: str = ""  # for anything not OK: what to do, in words
    brief: str = ""  # a few words for summary_line ("/dev/shm 64 MiB"); default: name

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, detail: str, fix: str = "", brief: str = "") -> Check:
        check = Check(name, status, detail, fix, brief)
        self.checks.append(check)
        return check

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_dict(self) -> dict:
        return {"checks": [dataclasses.asdict(c) for c in self.checks], "counts": self.counts(),
                "failed": self.failed, "summary": summary_line(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        return cls([Check(**c) for c in data["checks"]])

    def text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        out = ["sdp_jupyter doctor: paste this into a bug report"]
        for c in self.checks:
            out.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status != OK:
                out.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
        out.append(summary_line(self))
        return "\n".join(out)


def summary_line(report: Report) -> str:
    """One line: "doctor: 9 OK, 1 WARN (/dev/shm 64 MiB), 0 FAIL" (and the INFO count when any)."""
    def part(status):
        items = [c.brief or c.name for c in report.checks if c.status == status]
        n = report.counts()[status]
        return f"{n} {status}" + (f" ({'; '.join(items)})" if items and status in (WARN, FAIL) else "")

    line = f"doctor: {part(OK)}, {part(WARN)}, {part(FAIL)}"
    return line + (f", {part(INFO)}" if report.counts()[INFO] else "")
