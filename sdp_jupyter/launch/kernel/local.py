"""LocalLauncher: one process per (node, local rank) on this machine.

Each worker is started in its own session (so the kernel's Ctrl-C does not reach it; we decide how
it stops), with torchrun's and SageMaker's environment variables, its output read through a pipe
into its log and the job's views. A supervisor thread per job watches the workers: when one fails
the others are stopped (SIGINT, then SIGTERM, then SIGKILL), and the whole job is restarted up to
`max_restarts` times. Workers die with the process that launched them (parent-death signal, armed
in sdp_jupyter.launch.rank.worker), and an atexit hook (launch/kernel/supervise.py) stops every job still running here.
"""
from __future__ import annotations

import os
import queue
import secrets
import signal
import subprocess
import threading
import time
from pathlib import Path

from sdp_jupyter import jobdir
from sdp_jupyter.launch.kernel import backend_verdict
from sdp_jupyter.launch.host import ranks
from sdp_jupyter.launch.kernel import supervise
from sdp_jupyter.launch.kernel import warm_pool
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.spec import JobSpec, SpecError
from sdp_jupyter.launch.host.ranks import gpu_count
from sdp_jupyter.launch.process import free_port


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
        if spec.backend == "nccl" and gpus == 0:
            raise SpecError("--backend", "nccl needs a GPU and this machine has none. "
                                         "Fix: --backend smddp (or gloo)")
        ppn = spec.procs_per_node or max(gpus, 1)
        if gpus and spec.backend == "nccl" and ppn > gpus:
            raise SpecError("--procs-per-node", f"{ppn} processes but only {gpus} GPU(s) for nccl. "
                                                f"Fix: --procs-per-node {gpus}")
        if spec.script is not None and not Path(spec.script).is_file():
            raise SpecError("script", f"{spec.script} does not exist; give the path of a .py file")
        return spec.replace(name=spec.name or jobdir.new_job_name(), procs_per_node=ppn)

    def start(self, spec: JobSpec, push: dict | None = None) -> Job:
        spec = self.resolve(spec)
        push_bytes = pickle_push(spec.push, push or {})
        job_dir, spec = Job.create_dir(spec, push_bytes)
        job = Job(spec, job_dir)
        job.update_status(state="pending", created=time.time(), started=None, ended=None, exit_codes=[],
                    restarts=0, error=None, launcher_pid=os.getpid(), target="local",
                    world_size=spec.nodes * spec.procs_per_node)
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
        self.world_size = self.spec.nodes * self.spec.procs_per_node
        self.secret = secrets.token_hex(32)
        self.gpus = gpu_count()
        self.warm_choice = launcher.start_choice(self.spec)
        self._procs: list[subprocess.Popen] = []
        self._samplers: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []
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

            state, error, codes = supervise.with_restarts(job, lambda n: self._attempt(n, started), announce,
                                                          self._stop)
        except Exception as e:  # our own bug or an OS error: the job fails with it, nothing left running
            state, error = "failed", f"the launcher failed: {type(e).__name__}: {e}"
            self._terminate()
        finally:
            self._stop_samplers()
            for t in self._readers:
                t.join(timeout=2)
            supervise.unregister(self)
            warm_pool.job_done(self.warm_choice, self.spec.preload)
            job.update_status(state=state, error=error, exit_codes=codes, ended=time.time(),
                              **backend_verdict.verdict(job.dir, spec.backend, self.world_size, state))

    def _attempt(self, attempt: int, started: float) -> tuple[str, str | None, list]:
        port = free_port()
        script = str(self.job.dir / jobdir.SCRIPT) if self.spec.script is None else self.spec.script
        self._procs, readers = [], []
        exits: queue.Queue = queue.Queue()
        for rank in range(self.world_size):
            env = self.environment(rank, attempt, port)
            env["SDP_SCRIPT"] = script
            proc = self._spawn(ranks.WORKER, env)
            self._procs.append(proc)
            reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True,
                                      name=f"sdp-{self.job.name}-out{rank}")
            reader.start()
            readers.append(reader)
            self._readers.append(reader)
            threading.Thread(target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True).start()
        self.job.update_status(state="running", started=self.job.status.get("started") or time.time(),
                         port=port, pids=[p.pid for p in self._procs])
        codes: list = [None] * self.world_size
        remaining = self.world_size
        while remaining:
            if self._stop.is_set():
                codes = self._terminate()
                return "stopped", self._stop_reason, codes
            if self.spec.timeout and time.monotonic() - started > self.spec.timeout:
                codes = self._terminate()
                return "failed", f"timed out after {self.spec.timeout:g} s (--timeout)", codes
            try:
                rank, code = exits.get(timeout=0.1)
            except queue.Empty:
                continue
            codes[rank] = code
            remaining -= 1
            if code != 0:
                readers[rank].join(timeout=2)  # its last lines, for the error
                error = self._failure_message(rank, code)
                codes = self._terminate(codes)
                return "failed", error, codes
        self._cleanup_groups()
        return "succeeded", None, codes

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

    def _failure_message(self, rank: int, code: int) -> str:
        node, local_rank = divmod(rank, self.spec.procs_per_node)
        return ranks.failure_message(self.job, rank, f"rank {rank} (node {node}, local rank {local_rank})", code)

    def _read(self, rank: int, proc: subprocess.Popen) -> None:
        # Pieces of at most LINE_CAP bytes: the log gets every byte, the views get the first
        # LINE_CAP of a line (a 64 MiB line is never held whole, nor sent to the notebook).
        cap = jobdir.LINE_CAP
        cut = False
        with jobdir.open_private(jobdir.log_path(self.job.dir, rank)) as log:
            for raw in iter(lambda: proc.stdout.readline(cap), b""):
                log.write(raw)
                log.flush()
                if not cut:
                    text = raw.decode("utf-8", errors="replace")
                    if not raw.endswith(b"\n") and len(raw) >= cap:
                        text += f" … [line cut at {cap} bytes in this view; the log has it all]\n"
                        cut = True
                    self.job.emit_output(rank, text)
                elif raw.endswith(b"\n"):
                    cut = False
        proc.stdout.close()

    def _line(self, rank: int, text: str) -> None:
        with jobdir.open_private(jobdir.log_path(self.job.dir, rank), "a") as log:
            log.write(text)
        self.job.emit_output(rank, text)

    def _terminate(self, codes: list | None = None) -> list:
        """Stop every live rank (launch/host/ranks.py: SIGINT, SIGTERM, SIGKILL); return exit codes."""
        return ranks.stop(self._procs, self.launcher.sigint_grace, self.launcher.sigterm_grace)

    def _cleanup_groups(self) -> None:
        ranks.kill_groups(self._procs)

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
        for p in self._procs + self._samplers:
            ranks.signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs + self._samplers):
            time.sleep(0.02)
        for p in self._procs + self._samplers:
            ranks.signal_group(p.pid, signal.SIGKILL)
