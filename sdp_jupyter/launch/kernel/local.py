"""LocalLauncher: one process per (node, local rank) on this machine.

Each worker is started in its own session (so the kernel's Ctrl-C does not reach it; we decide how
it stops), with torchrun's and SageMaker's environment variables, its output read through a pipe
into its log and the job's views. A supervisor thread per job watches the workers: when one fails
the others are stopped (SIGINT, then SIGTERM, then SIGKILL), and the whole job is restarted up to
`max_restarts` times. Workers die with the process that launched them (parent-death signal, armed
in sdp_jupyter.launch.rank.worker), and an atexit hook (launch/kernel/supervise.py) stops every job still running here.
"""
from __future__ import annotations

import queue
import secrets
import socket
import signal
import subprocess
import time
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel import backend_verdict
from sdp_jupyter.launch.host import ranks, session_store
from sdp_jupyter.launch.host.node import NodeRanks, ViewCut
from sdp_jupyter.launch.kernel import supervise
from sdp_jupyter.launch.kernel import warm_pool
from sdp_jupyter.launch.kernel.heal_records import HealRecords, heal_line, left_why
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.preparation import create_job, prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter import backends
from sdp_jupyter.launch.spec import JobSpec, SpecError
from sdp_jupyter.launch.host.ranks import gpu_count
from sdp_jupyter._net import free_port


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
        run = LocalRun(job, self)
        job.supervisor = run
        run.start()
        return job


class LocalRun(supervise.Run):
    """The supervisor of one local job: spawns, watches, restarts and stops its processes."""

    def __init__(self, job: Job, launcher: LocalLauncher):
        self.job = job
        self.spec = job.spec
        self.launcher = launcher
        self.world_size = self.spec.world_size
        self.secret = secrets.token_hex(32)
        self.gpus = gpu_count()
        self.warm_choice = launcher.start_choice(self.spec)
        self._node: NodeRanks | None = None  # this attempt's ranks (every node of a local job is on this host)
        self._samplers: list[subprocess.Popen] = []
        self._session = False  # a session's job that replaces its dead ranks
        self._store = None  # a session's store process (launch/host/session_store.py), when it has one
        self._lost: dict[int, str] = {}  # the session's dead ranks waiting for replace_rank: {rank: why}
        self._live: set[int] = set()  # the ranks whose process runs
        self._rank_env: dict[int, dict] = {}  # each rank's environment in this attempt (a replacement's too)
        self._heal = HealRecords(job.dir, self.world_size) if self.spec.heal else None  # --heal: sdp_jupyter.heal
        supervise.Run.__init__(self, f"sdp-job-{job.name}")

    # ------------------------------------------------------------------ environment
    def environment(self, rank: int, attempt: int, port: int) -> dict:
        return ranks.environment(self.spec, rank=rank, world_size=self.world_size, job_dir=str(self.job.dir),
                                 job_name=self.job.name, secret=self.secret, master_addr="127.0.0.1",
                                 master_port=port, bind_addr="127.0.0.1", attempt=attempt, gpus=self.gpus,
                                 ranks_here=self.world_size, split_gpus=True)

    # ------------------------------------------------------------------ supervision
    def _supervise(self) -> None:
        job, spec = self.job, self.spec
        state, error, codes = "failed", None, []
        started = time.monotonic()
        try:
            Path(self.job.dir / jobdir.CHECKPOINTS).mkdir(exist_ok=True)
            if spec.checkpoint_dir:
                Path(spec.checkpoint_dir).expanduser().mkdir(parents=True, exist_ok=True)
            self._start_samplers()

            def announce(text: str) -> None:
                for rank in range(self.world_size):
                    self._line(rank, text)

            if self._heal is not None:  # dead ranks are replaced in place; --max-restarts counts them
                state, error, codes = self._attempt(0, started)
            else:
                state, error, codes = supervise.with_restarts(job, lambda n: self._attempt(n, started), announce,
                                                              self._stop)
        except Exception as e:  # our own bug or an OS error: the job fails with it, nothing left running
            state, error = "failed", f"the launcher failed: {type(e).__name__}: {e}"
            self._terminate()
        finally:
            self._stop_samplers()
            session_store.stop(self._store)
            if self._node is not None:
                self._node.join_readers()
            supervise.unregister(self)
            warm_pool.job_done(self.warm_choice, self.spec.preload)
            job.update_status(state=state, error=error, exit_codes=codes, ended=time.time(),
                              **backend_verdict.verdict(job.dir, spec.backend, self.world_size, state))

    def _attempt(self, attempt: int, started: float) -> tuple[str, str | None, list]:
        port = free_port(ports=self.spec.env.get("SDP_PORT_RANGE"))
        script = str(self.job.dir / jobdir.SCRIPT) if self.spec.script is None else self.spec.script
        views = {rank: ViewCut() for rank in range(self.world_size)}

        def shown(rank: int, raw: bytes) -> None:
            text = views[rank].text(raw)
            if text is not None:
                self.job.emit_output(rank, text)

        if (self.spec.env.get("SDP_SESSION_STORE") or self._heal is not None) and self._store is None:
            self._store = session_store.start(self.job.dir, "127.0.0.1", port)
        node = self._node = NodeRanks(self.job.dir, shown, name=f"sdp-{self.job.name}", job_env=self.spec.env)
        self._live = set(range(self.world_size))
        if self._heal is not None:
            self._heal.begin()
        for rank in range(self.world_size):
            env = self._rank_env[rank] = self.environment(rank, attempt, port)
            env["SDP_SCRIPT"] = script
            node.add(rank, self._spawn(ranks.WORKER, env))
        if self._store is not None:
            session_store.ready(self._store)
        self.job.update_status(state="running", started=self.job.status.get("started") or time.time(),
                         port=port, pids=node.pids)
        codes: list = [None] * self.world_size
        while self._live:
            if self._stop.is_set():
                codes = self._terminate()
                return "stopped", self._stop_reason, codes
            if self.spec.timeout and time.monotonic() - started > self.spec.timeout:
                codes = self._terminate()
                return "failed", f"timed out after {self.spec.timeout:g} s (--timeout)", codes
            if self._heal is not None and self._heal.admit():  # the job view reads the join mid-job too
                self.job.update_status(heals=list(self._heal.history))
            ended = self._next_exit(node, codes, 0.1)
            if ended is None:
                continue
            rank, code = ended
            if code != 0:
                if self._session:  # the session replaces it (replace_rank) and goes on
                    self._lost[rank] = ranks.failure_message(self.job, rank, self._who(rank), code)
                    continue
                if self._heal is not None and self._heal.replaced < self.spec.max_restarts \
                        and len(self._heal.members) > 1 and not self._stop.is_set():
                    self._heal_rank(rank, code)
                    continue
                failed = self._settle(node, codes, rank)
                error = supervise.job_error(self.job, failed, codes, self._who, lambda _rank: socket.gethostname())
                codes = self._terminate(codes)
                return "failed", error, codes
        self._cleanup_groups()
        return "succeeded", None, codes

    def _heal_rank(self, rank: int, code: int) -> None:
        """--heal: the others go on without `rank` (a new record), and it starts again to join them."""
        why = left_why(self.job, rank, self._who(rank), code)
        generation = self._heal.leave(rank, why)
        proc = self._spawn(ranks.WORKER, {**self._rank_env[rank], "SDP_HEAL_JOIN": "1"})
        self._live.add(rank)
        self._node.add(rank, proc)
        for r in range(self.world_size):
            self._line(r, heal_line(self._heal, self.spec.max_restarts, why, generation, rank, f"pid {proc.pid}"))
        self.job.update_status(pids=self._node.pids, heals=list(self._heal.history))

    def _settle(self, node: NodeRanks, codes: list, first: int) -> list[int]:
        """The ranks that failed, `first` and those whose exits follow within supervise.SETTLE_S (their
        last lines read), in the order they ended."""
        failed = [first]
        deadline = time.monotonic() + supervise.SETTLE_S
        while self._live and time.monotonic() < deadline:
            ended = self._next_exit(node, codes, 0.05)
            if ended is not None and ended[1] != 0:
                failed.append(ended[0])
        return failed

    def _next_exit(self, node: NodeRanks, codes: list, timeout: float) -> tuple[int, int] | None:
        """The next rank to end (its code recorded; a failed rank's last lines read, for the error), or
        None when none ends within `timeout`."""
        try:
            rank, code = node.exits.get(timeout=timeout)
        except queue.Empty:
            return None
        codes[rank] = code
        self._live.discard(rank)
        if code != 0:
            node.last_lines(rank)
        return rank, code

    def _spawn(self, argv: list, env: dict):
        """A rank's process: forked by the warm pool (launch/host/warm.py) or started cold; same contract."""
        if warm_pool.wanted(self.warm_choice):
            proc = warm_pool.start_rank(argv, env, preload=self.spec.preload)
            if not isinstance(proc, str):
                if self.job.status.get("start") is None:
                    self.job.update_status(start="warm")
                return proc
            if self.job.status.get("start_reason") is None:  # one cold rank makes the job "cold"
                self.job.update_status(start="cold", start_reason=f"warm start not possible: {proc}")
        elif self.job.status.get("start") is None:
            self.job.update_status(start="cold")
        return ranks.spawn(env)

    def _who(self, rank: int) -> str:
        node, local_rank = divmod(rank, self.spec.procs_per_node)
        return f"rank {rank} (node {node}, local rank {local_rank})"

    def _line(self, rank: int, text: str) -> None:
        with jobdir.open_private(jobdir.log_path(self.job.dir, rank), "a") as log:
            log.write(text)
        self.job.emit_output(rank, text)

    def _terminate(self, codes: list | None = None) -> list:
        """Stop every live rank (launch/host/ranks.py: SIGINT, SIGTERM, SIGKILL); return exit codes."""
        return self._node.stop(self.launcher.sigint_grace, self.launcher.sigterm_grace) if self._node else []

    def _cleanup_groups(self) -> None:
        if self._node is not None:
            self._node.kill_groups()

    # ------------------------------------------------------------------ an interactive session's channel
    def open_session(self, replace: bool = False) -> None:
        self._session = replace

    def lost_ranks(self) -> dict:
        return dict(self._lost)

    def replace_rank(self, rank: int, join: str) -> None:
        why = self._lost.pop(rank)
        proc = self._spawn(ranks.WORKER, {**self._rank_env[rank], "SDP_SESSION_JOIN": join})
        self._live.add(rank)
        self._node.add(rank, proc)
        self.job.update_status(pids=self._node.pids)
        self._line(rank, f"[sdp_jupyter] rank {rank} started again (pid {proc.pid}) after: {why.splitlines()[0]}\n")

    def put_session_file(self, name: str, data: bytes) -> None:
        jobdir.write_private(jobdir.session_dir(self.job.dir) / name, data)

    def interrupt_ranks(self) -> None:
        from sdp_jupyter.launch.rank.session import INTERRUPT

        for proc in (self._node.procs if self._node else []):
            ranks.signal_rank(proc, INTERRUPT)

    # ------------------------------------------------------------------ per-node samplers
    def _start_samplers(self) -> None:
        for node in range(self.spec.nodes):
            proc = ranks.start_sampler(self.job.dir, node)
            if proc is not None:
                self._samplers.append(proc)

    def _stop_samplers(self) -> None:
        ranks.stop_samplers(self._samplers)

    def kill_now(self) -> None:
        """At interpreter exit: no grace, nothing may survive us."""
        self._stop.set()
        procs = (self._node.procs if self._node else []) + self._samplers + ([self._store] if self._store else [])
        for p in procs:
            ranks.signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.02)
        for p in procs:
            ranks.signal_group(p.pid, signal.SIGKILL)
