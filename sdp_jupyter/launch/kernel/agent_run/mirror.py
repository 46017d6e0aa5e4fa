"""What a remote run writes into the job directory as its agents send it (launch/kernel/agent_run/run.py mixes it
in): each rank's output into its log and its view, the ranks' metrics files, the agents' own stderr, and the
frames meant for a session or a stacks request handed on to them."""
from __future__ import annotations

from sdp_jupyter import jobdir
from sdp_jupyter.launch import channel
from sdp_jupyter.launch.kernel.rank_report import ViewCut


class MirrorChannel:
    """AgentRun's copy of what its agents send into the job directory and the views."""

    def _mirror(self, message: dict) -> bool:
        """Output and metrics go into the job directory and the views; True when `message` was one."""
        if message["type"] == "out":
            self._out(int(message["rank"]), message["text"], logged=self.logs_written)
        elif message["type"] == "metrics":
            self._metrics(message)
        elif message["type"] == "stacks":  # Job.stacks()'s answer (launch/kernel/agent_run/rank_requests.py)
            self._stacks_answer(message)
        elif message["type"] == "answer":  # a session's rank's (launch/host/session_relay.py)
            self.session_mail.put((message["kind"], message.get("n"), int(message["rank"]),
                                   channel.unb64(message["data"])))
        else:
            return False
        return True

    def _out(self, rank: int, text: str, logged: bool = False) -> None:
        """A piece of a rank's output into its log (unless `logged` already) and its view."""
        if not logged:
            self._mirror_files.append(jobdir.log_path(self.job.dir, rank), text)
        shown = self._views.setdefault(rank, ViewCut()).text(text.encode("utf-8", "surrogateescape"))
        if shown is not None:  # the view shows a line's first LINE_CAP bytes, as for a local job
            self.job.emit_output(rank, shown)

    def _metrics(self, message: dict) -> None:
        name = str(message.get("file", ""))
        if not jobdir.is_metrics_name(name):  # never a path: only the names the agent may send
            return
        self.write_metrics(name, str(message.get("lines", "")))

    def _write_agent_logs(self) -> None:
        for conn in self.conns:
            if conn.stderr:
                self._mirror_files.append(jobdir.agent_log_path(self.job.dir, conn.node), "\n".join(conn.stderr) + "\n")

    def write_metrics(self, name: str, text: str) -> None:
        """Append `text` (whole JSON lines) to the job's metrics file `name`, in order with what the agents sent."""
        self._mirror_files.append(self.job.dir / jobdir.METRICS / name, text)
