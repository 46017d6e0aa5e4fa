"""A --heal job's membership as its launcher decides it (agent_run/heal_channel.py, every agent-run target): the records its
ranks read (sdp_jupyter.heal), and the words each change is announced with."""
from __future__ import annotations

import time
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel import rank_report


def left_why(job, rank: int, who: str, code: int) -> str:
    """Why `rank` left: the first line of its failure message, without the lead-in to its last lines."""
    return rank_report.failure_message(job, rank, who, code).splitlines()[0].removesuffix("; its last lines:")


def heal_line(records: "HealRecords", max_restarts: int, why: str, generation: int, rank: int, where: str) -> str:
    """The line every rank's log gets when `rank` left and was started again (`where`: its pid or host)."""
    return (f"[sdp_jupyter] heal {records.replaced} of {max_restarts}: {why}; the {len(records.members)} ranks "
            f"left go on (generation {generation}); rank {rank} started again ({where}) joins them at a step "
            "boundary\n")


class HealRecords:
    """A --heal job's membership, as the launcher decides it and writes it for its ranks (jobdir's heal
    records, read by sdp_jupyter.heal): generation 0 has every rank; a death makes the next generation
    without the dead rank; a replacement that said it is ready is let in by the generation after the
    ranks left have all formed theirs (it then joins at their next step boundary)."""

    def __init__(self, job_dir: Path, world_size: int):
        self.dir, self.world_size = Path(job_dir), world_size
        self.generation = -1
        self.members: list[int] = []
        self.joining: list[int] = []  # started again, not yet let in
        self.replaced = 0
        self.history: list[dict] = []  # each change: {generation, at, members, left | joined}

    def _write(self, members: list[int], joining: list[int], left: dict) -> int:
        self.generation += 1
        self.members = members
        record = {"generation": self.generation, "members": members, "joining": joining,
                  "left": {str(r): why for r, why in left.items()}}
        jobdir.write_json_atomic(jobdir.heal_record_path(self.dir, self.generation), record)
        self.history.append({"generation": self.generation, "at": time.time(), "members": members,
                             **({"left": record["left"]} if left else {}), **({"joined": joining} if joining else {})})
        return self.generation

    def record_file(self) -> tuple[str, bytes]:
        """The current record's file name and bytes (a remote job sends it to every agent)."""
        path = jobdir.heal_record_path(self.dir, self.generation)
        return path.name, path.read_bytes()

    def begin(self) -> None:
        jobdir.ensure_private_dir(self.dir / jobdir.HEAL)
        self._write(list(range(self.world_size)), [], {})

    def leave(self, rank: int, why: str) -> int:
        """`rank` died: the next generation goes on without it; it is started again (counted)."""
        self.replaced += 1
        self.joining = [r for r in self.joining if r != rank] + [rank]
        jobdir.heal_ready_path(self.dir, rank).unlink(missing_ok=True)
        if rank not in self.members:  # a replacement that died before it was let in: nothing changes for the others
            return self.generation
        return self._write([r for r in self.members if r != rank], [], {rank: why})

    def admit(self) -> bool:
        """Let in the replacements that are ready once every member has formed the current generation
        (True when a record was written); nothing to look at while none is waiting."""
        ready = [r for r in self.joining if jobdir.heal_ready_path(self.dir, r).exists()]
        if not ready or jobdir.heal_finished_path(self.dir).exists():  # training ended: nobody is let in
            return False
        if not all(jobdir.heal_formed_path(self.dir, self.generation, m).exists() for m in self.members):
            return False
        for r in ready:
            jobdir.heal_ready_path(self.dir, r).unlink(missing_ok=True)
        self.joining = [r for r in self.joining if r not in ready]
        self._write(self.members + ready, ready, {})
        return True
