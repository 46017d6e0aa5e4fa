"""A --heal job on a remote run (launch/kernel/agent_run/run.py mixes it in): the launcher keeps the membership
(heal_records.py) as for a local job, and the agents carry its files both ways. Each record goes to every
node's agent, which writes it where its ranks read it (sdp_jupyter.heal); what the ranks write for the
launcher (a replacement is ready, a member formed its group, training finished) comes back as frames
into the job directory here, and `finished` goes on to every other host (a replacement waiting there leaves).
A rank that dies is started again by its own host's agent."""
from __future__ import annotations

from sdp_jupyter import jobdir
from sdp_jupyter.launch import channel
from sdp_jupyter.launch.kernel.heal_records import HealRecords, heal_line, left_why


class HealChannel:
    """AgentRun's side of a --heal job: `_heal` is None for any other job."""

    _heal: HealRecords | None = None

    def _heal_begin(self) -> dict:
        """Generation 0 (every rank), as the start frames carry it; {} for a job without --heal."""
        if not self.spec.heal:
            return {}
        self._heal = HealRecords(self.job.dir, self.spec.world_size)
        self._heal.begin()
        return {"heal": self._heal_frame()}

    def _heal_frame(self) -> dict:
        name, data = self._heal.record_file()
        return {"type": "heal", "name": name, "data": channel.b64(data)}

    def _heal_answer(self, node: int, message: dict) -> bool:
        """A file a node's ranks wrote for the launcher, written into the job directory (True when
        `message` was one)."""
        if message["type"] != "heal":
            return False
        name = str(message.get("name", ""))
        if not jobdir.is_heal_answer(name) or self._heal is None:  # never a path: only the names a rank writes
            return True
        path = self.job.dir / jobdir.HEAL / name
        if name == jobdir.HEAL_FINISHED:
            if path.exists():
                return True
            for conn in self.nodes():
                if conn.node != node:
                    conn.send({"type": "heal", "name": name, "data": message["data"]})
        jobdir.write_private(path, channel.unb64(message["data"]))
        return True

    def _heal_admit(self) -> None:
        """Let the ready replacements in once every member formed the current generation."""
        if self._heal is not None and self._heal.admit():
            self._heal_publish()

    def _heal_publish(self) -> None:
        frame = self._heal_frame()
        for conn in self.nodes():
            conn.send(frame)
        self.job.update_status(heals=list(self._heal.history))

    def _heal_rank(self, rank: int, code: int) -> bool:
        """A rank ended with `code` != 0: in a --heal job with replacements left and another member, the
        others go on without it (a new record to every host) and its host's agent starts it again (True)."""
        heal = self._heal
        if heal is None or heal.replaced >= self.spec.max_restarts or len(heal.members) <= 1 or self._stop.is_set():
            return False
        why = left_why(self.job, rank, self._who(rank), code)
        before = heal.generation
        generation = heal.leave(rank, why)
        if generation != before:
            self._heal_publish()
        else:
            self.job.update_status(heals=list(heal.history))
        node = self.nodes()[rank // self.spec.procs_per_node]
        node.send({"type": "respawn", "rank": rank, "heal": True})
        for r in range(self.spec.world_size):
            self._out(r, heal_line(heal, self.spec.max_restarts, why, generation, rank, f"on host {node.host}"))
        return True
