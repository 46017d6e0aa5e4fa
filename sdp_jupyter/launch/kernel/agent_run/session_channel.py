"""An interactive session's channel on a remote run (launch/kernel/agent_run/run.py mixes it in): cells and
interrupts out to every node's agent, dead ranks started again on their host, and a host gone for good
kept apart for the session's choice (launch/kernel/session.py: shrink or stop)."""
from __future__ import annotations

from sdp_jupyter.launch import channel


class SessionChannel:
    """AgentRun's side of launch/kernel/session.py (the contract is supervise.Run's)."""

    def open_session(self, replace: bool = False) -> None:
        self._replace = replace
        self.session = True  # links made later (a Slurm allocation's) hear it in their start frame
        for conn in self.conns:
            conn.send({"type": "session"})

    def lost_ranks(self) -> dict:
        return dict(self._lost)

    def _host_gone(self, position: int, why: str) -> bool:
        """A session's node `position` lost its host (`why`): its ranks wait in lost_ranks and gone_ranks
        for the session's choice. False (the job fails) for a job, and for node 0 (it ran the store)."""
        if not self._replace or position == 0:
            return False
        ppn = self.spec.procs_per_node
        for rank in range(position * ppn, (position + 1) * ppn):
            self._gone[rank] = f"{self._who(rank)} was lost with its host: {why}"
            self._lost[rank] = self._gone[rank]
        return True

    def _host_lost(self, host: str, position: int, why: str) -> str:
        """The job's error for a lost host."""
        return f"host {host} (node {position}): {why}" + (
            "; a session cannot go on without node 0's host: its store ran there" if self._replace and not position else "")

    def gone_ranks(self) -> dict:
        return dict(self._gone)

    def drop_ranks(self, ranks: list) -> None:
        for rank in ranks:
            self._lost.pop(rank, None)

    def replace_rank(self, rank: int, join: str) -> None:
        self._respawning[rank] = self._lost.pop(rank)
        self.nodes()[rank // self.spec.procs_per_node].send({"type": "respawn", "rank": rank, "join": join})

    def send_cell(self, n: int, data: bytes) -> None:
        frame = {"type": "cell", "n": n, "data": channel.b64(data)}
        for conn in self.nodes():
            conn.send(frame)

    def interrupt_ranks(self) -> None:
        for conn in self.nodes():
            conn.send({"type": "interrupt"})
