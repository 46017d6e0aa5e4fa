"""The local target: every node of the job is a node agent (launch/host/agent.py) on this machine.

Each node's agent is a child of this process, reached over a pipe (its stdin and stdout) with the same
frames as an SSH host's: the agent starts its ranks warm or cold, reads their output, watches their
exits, stops them (SIGINT, SIGTERM, SIGKILL) and starts a dead one again, exactly as it does on a remote
host; the run here (launch/kernel/agent_run/run.py) asks for the port, sends the start frames, restarts the job
up to `max_restarts` times, replaces a session's dead rank and heals a --heal job. What differs locally
is only the folder: the agents work in the job directory itself (`shared_dir`), so the ranks' logs,
metrics, result, session answers and heal records are where the kernel reads them, with no copy.

Agents die with this process (parent-death signal, launch/process.start_kept) and their ranks with
them; an atexit hook (launch/kernel/supervise.py) stops every job still running here.
"""
from __future__ import annotations

import os
import queue
import socket
import sys

import psutil

from sdp_jupyter import backends, jobdir
from sdp_jupyter.launch import process
from sdp_jupyter.launch.host.ranks import gpu_count
from sdp_jupyter.launch.kernel import warm_pool
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.agent_run.link import ProcessLink
from sdp_jupyter.launch.kernel.preparation import create_job, prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.kernel.agent_run.run import HEARTBEAT_TIMEOUT, AgentRun  # the loop's clock, as _silence says it
from sdp_jupyter.launch.spec import JobSpec, SpecError

AGENT = "sdp_jupyter.launch.host.agent"


class LocalLauncher:
    """Runs a JobSpec as local processes. Grace periods (seconds) apply when stopping ranks."""

    def __init__(self, sigint_grace: float = 3.0, sigterm_grace: float = 2.0, warm: bool | None = None):
        self.sigint_grace = sigint_grace
        self.sigterm_grace = sigterm_grace
        self.warm = warm  # True/False: every job warm/cold (launch/host/warm.py); None: each spec's --warm/--cold/auto

    def start_choice(self, spec: JobSpec) -> bool | None:
        """Warm (True), cold (False) or the default (None: warm_pool.wanted decides) for this job's ranks:
        the constructor's `warm=` when given, else the spec's --warm / --cold."""
        if self.warm is not None:
            return self.warm
        return {"warm": True, "cold": False}.get(spec.start)

    def resolve(self, spec: JobSpec) -> JobSpec:
        """Fill in what depends on this machine (name, processes per node) and check it can run here."""
        gpus = gpu_count()
        ppn = spec.procs_per_node or max(gpus, 1)
        short = backends.gpu_shortfall(spec.backend, ppn, gpus, "this machine", "--backend smddp (or gloo)")
        if short:
            raise SpecError(*short)
        return prepared(spec, procs_per_node=ppn)

    def start(self, spec: JobSpec, push: dict | None = None) -> Job:
        spec = self.resolve(spec)
        push_bytes = pickle_push(spec.push, push or {})
        job = create_job(spec, push_bytes)
        run = LocalRun(spec, self)
        run.attach(job, push_bytes)
        job.supervisor = run
        run.start()  # the agents start in the run's thread: the caller has its job at once
        return job


class LocalLink(ProcessLink):
    """One node's agent, a child of this process; its stdin and stdout are the channel."""

    kind = "agent"

    def __init__(self, node: int, inbox: queue.Queue):
        super().__init__(node, f"localhost/{node}", inbox)
        env = {**os.environ, "SDP_AGENT_ADDR": "127.0.0.1",  # every rank and store of the job on loopback
               "PYTHONPATH": process.rank_pythonpath(os.environ.get("PYTHONPATH"), compat=False)}
        env.pop("SDP_LAUNCHER_PID", None)
        self.begin(process.start_kept([sys.executable, "-u", "-m", AGENT], env=env))
        self.connected.set()  # nothing to reach: the interpreter starts at once


class LocalRun(AgentRun):
    """The supervisor of one local job: one agent per node over a pipe, the job directory shared."""

    logs_written = True  # the agents' NodeRanks write each rank's log in the job directory

    def __init__(self, spec: JobSpec, launcher: LocalLauncher):
        # one name per node agent, as its link has it ("localhost/1"): what an error, the status and an
        # elastic job's timeline say
        super().__init__(spec, [f"localhost/{node}" for node in range(spec.nodes)], launcher)
        self.warm_choice = launcher.start_choice(spec)
        self._pids: dict[int, int] = {}

    def links_in_run(self) -> None:
        self.preflight()  # this machine's agents: nothing to refuse, only our own failure to start one

    def open_links(self) -> list[LocalLink]:
        links = []
        try:
            for node in range(self.spec.nodes):
                links.append(LocalLink(node, self.inbox))
        except BaseException:
            for link in links:
                link.close(wait=1.0)
            raise
        return links

    def reopen(self, node: int, inbox: queue.Queue) -> LocalLink:
        """An elastic job's lost node: its agent (killed, out of memory) started again here."""
        return LocalLink(node, inbox)

    def start_fields(self) -> dict:
        # every node's ranks share this machine's threads and GPUs (ranks.environment)
        return {"shared_dir": str(self.job.dir), "ranks_here": self.spec.world_size, "split_gpus": True}

    def attempt(self, attempt: int):
        (self.job.dir / jobdir.RESULT).unlink(missing_ok=True)
        self._pids = {}  # an elastic job's new formation may have fewer ranks
        (self.job.dir / jobdir.CHECKPOINTS).mkdir(exist_ok=True)
        if self.spec.checkpoint_dir:
            os.makedirs(os.path.expanduser(self.spec.checkpoint_dir), exist_ok=True)
        return super().attempt(attempt)

    def _spawned(self, rank: int, pid: int) -> None:
        super()._spawned(rank, pid)
        self._pids[rank] = pid  # the pids a reader checks when it finds the job running and us gone
        self.job.update_status(pids=[self._pids[r] for r in sorted(self._pids)])

    # ---------------------------------------------------------------- warm starts: this process's pool
    def _warm_fields(self) -> dict[int, dict]:
        if not warm_pool.wanted(self.warm_choice):
            return {}
        pool = warm_pool.warm_up(warm_pool.job_preload(self.spec))
        refused = warm_pool.refusal(pool, self.spec.backend)
        address, reason = (None, refused) if refused else pool.address()  # the pings go on meanwhile
        fields = {"warm": address} if address else {"cold_reason": reason}
        return {conn.node: fields for conn in self.nodes()}

    def _warm_after(self) -> None:
        warm_pool.job_done(self.warm_choice, warm_pool.job_preload(self.spec))

    def _started_where(self, node: int) -> str:
        return ""

    # ---------------------------------------------------------------- what a local job says
    def _host(self, rank: int) -> str:
        return socket.gethostname()

    def _who(self, rank: int) -> str:
        node, local_rank = divmod(rank, self.spec.procs_per_node)
        return f"rank {rank} (node {node}, local rank {local_rank})"

    def _host_lost(self, host: str, position: int, why: str) -> str:
        text = super()._host_lost(host, position, why)
        spec = self.spec
        if spec.elastic or spec.heal or self._replace:
            return text  # it re-forms, or the session asks what to do
        return (f"{text}. Fix: --nodes {spec.nodes}:{spec.nodes} makes the job elastic: a killed node agent is "
                "started again and the job goes on from its checkpoint, spending no --max-restarts")

    def _silence(self, conn: LocalLink) -> str:
        """A local agent that went silent is on this machine: say what state it is in."""
        try:
            state = psutil.Process(conn.proc.pid).status()
        except psutil.Error:
            state = "gone"
        said = {psutil.STATUS_STOPPED: "stopped (SIGSTOP)", psutil.STATUS_TRACING_STOP: "stopped by a debugger",
                psutil.STATUS_ZOMBIE: "ended", "gone": "ended"}.get(state, f"{state}, not reading its channel")
        return f"its agent (pid {conn.proc.pid}) has not answered for {HEARTBEAT_TIMEOUT:g} s: {said}"

    def eof_reason(self, node: int, message: dict) -> str:
        """A node agent that ended before the job (killed, out of memory): its ranks died with it."""
        said = "; ".join(line for line in list(self.conns[node].stderr)[-3:] if line)
        return (f"its agent (pid {self.conns[node].proc.pid}) {jobdir.describe_exit(message['code'])}, and its "
                f"ranks with it{': ' + said if said else ''}")

