"""LocalLauncher: one process per (node, local rank) on this machine.

Each worker is started in its own session (so the kernel's Ctrl-C does not reach it; we decide how
it stops), with torchrun's and SageMaker's environment variables, its output read through a pipe
into its log and the job's views. A supervisor thread per job watches the workers: when one fails
the others are stopped (SIGINT, then SIGTERM, then SIGKILL), and the whole job is restarted up to
`max_restarts` times. Workers die with the process that launched them (parent-death signal, armed
in sdp_jupyter.launch.worker), and an atexit hook stops every job still running here.
"""
from __future__ import annotations

import atexit
import importlib.util
import io
import json
import os
import pickle
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from sdp_jupyter.launch import jobdir, warm
from sdp_jupyter.launch.job import Job
from sdp_jupyter.launch.spec import JobSpec, SpecError
from sdp_jupyter.launch.pythonpath import COMPAT_DIR, PACKAGE_PARENT, smdistributed_installed  # noqa: F401

LAST_LINES = 12  # lines of a failed rank's output quoted in the job's error

_ACTIVE: set["LocalRun"] = set()
_ACTIVE_LOCK = threading.Lock()


def gpu_count() -> int:
    """GPUs this machine offers (NVML, limited by CUDA_VISIBLE_DEVICES); 0 without a GPU or driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    try:
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        try:
            n = int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return 0
    if visible is not None:
        n = min(n, len([v for v in visible.split(",") if v.strip()]))
    return n


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class LocalLauncher:
    """Runs a JobSpec as local processes. Grace periods (seconds) apply when stopping ranks."""

    def __init__(self, sigint_grace: float = 3.0, sigterm_grace: float = 2.0, warm: bool | None = None):
        self.sigint_grace = sigint_grace
        self.sigterm_grace = sigterm_grace
        self.warm = warm  # True/False: warm/cold starts (launch/warm.py); None: SDP_WARM, else warm after a first job

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
        job._update(state="pending", created=time.time(), started=None, ended=None, exit_codes=[],
                    restarts=0, error=None, launcher_pid=os.getpid(), target="local",
                    world_size=spec.nodes * spec.procs_per_node)
        run = LocalRun(job, self)
        job._run = run
        run.start()
        return job


def pickle_push(names: list, values: dict) -> bytes | None:
    """Pickle the --push variables, or raise SpecError naming the one that is missing or unpicklable."""
    if not names:
        return None
    missing = [n for n in names if n not in values]
    if missing:
        raise SpecError("--push", f"variable {missing[0]!r} is not defined in the notebook; "
                                  "define it first or remove it from --push")
    for n in names:
        try:
            _dumps(values[n])
        except Exception as e:
            raise SpecError("--push", f"variable {n!r} ({type(values[n]).__name__}) cannot be pickled ({e}); "
                                      "push plain data (arrays, lists, dicts) instead") from None
    return _dumps({n: values[n] for n in names})


class _PushPickler(pickle.Pickler):
    """Refuses what only the notebook can unpickle: classes and functions defined in __main__ are
    pickled by reference, and a worker's __main__ is the script, so they would fail there."""

    def reducer_override(self, obj):
        owner = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
        if getattr(owner, "__module__", None) == "__main__":
            raise pickle.PicklingError(f"{getattr(owner, '__qualname__', owner)} is defined in the notebook, "
                                       "so the workers cannot load it; define it in the cell or a module")
        return NotImplemented


def _dumps(value) -> bytes:
    buffer = io.BytesIO()
    _PushPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buffer.getvalue()


class LocalRun:
    """The supervisor of one local job: spawns, watches, restarts and stops its processes."""

    def __init__(self, job: Job, launcher: LocalLauncher):
        self.job = job
        self.spec = job.spec
        self.launcher = launcher
        self.world_size = self.spec.nodes * self.spec.procs_per_node
        self.secret = secrets.token_hex(32)
        self.gpus = gpu_count()
        self._stop = threading.Event()
        self._stop_reason: str | None = None
        self._procs: list[subprocess.Popen] = []
        self._samplers: list[subprocess.Popen] = []
        self._readers: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._supervise, name=f"sdp-job-{job.name}", daemon=True)

    def start(self) -> None:
        with _ACTIVE_LOCK:
            _ACTIVE.add(self)
        self._thread.start()

    def stop(self, reason: str | None = None) -> None:
        self._stop_reason = self._stop_reason or reason
        self._stop.set()

    # ------------------------------------------------------------------ environment
    def environment(self, rank: int, attempt: int, port: int) -> dict:
        spec = self.spec
        ppn = spec.procs_per_node
        node, local_rank = divmod(rank, ppn)
        env = dict(os.environ)
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // (spec.nodes * ppn))))
        env.update(spec.env)
        env.update(spec.parallel_env())  # SDP_TP, SDP_PP, ...: only for a job with hybrid-parallel options
        paths = [PACKAGE_PARENT]
        if not smdistributed_installed():
            paths.insert(0, COMPAT_DIR)
        if env.get("PYTHONPATH"):
            paths.append(env["PYTHONPATH"])
        job_dir = str(self.job.dir)
        hosts = [f"algo-{i + 1}" for i in range(spec.nodes)]
        env.update({
            "PYTHONPATH": os.pathsep.join(paths),
            "PYTHONUNBUFFERED": "1",
            "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(ppn), "GROUP_RANK": str(node), "NODE_RANK": str(node),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": hosts[node],
            "SM_NUM_GPUS": str(min(ppn, self.gpus)),
            "SM_MODEL_DIR": os.path.join(job_dir, "model"),
            "SM_OUTPUT_DATA_DIR": os.path.join(job_dir, "output"),
            "SM_HPS": json.dumps(spec.hyperparameters),
            "SDP_JOB_DIR": job_dir, "SDP_JOB_NAME": self.job.name, "SDP_JOB_SECRET": self.secret,
            "SDP_BIND_ADDR": "127.0.0.1", "SDP_NUM_NODES": str(spec.nodes), "SDP_BACKEND": spec.backend,
            "SDP_RESTART": str(attempt), "SDP_LAUNCHER_PID": str(os.getpid()),
        })
        env.setdefault("SM_CHANNEL_TRAIN", os.path.join(job_dir, "data", "train"))
        if self.gpus >= spec.nodes * ppn and "CUDA_VISIBLE_DEVICES" not in spec.env:
            # each local "node" sees its own GPUs, as separate hosts would (LOCAL_RANK indexes them)
            parent = os.environ.get("CUDA_VISIBLE_DEVICES")
            ids = [v.strip() for v in parent.split(",")] if parent else [str(i) for i in range(self.gpus)]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[node * ppn:(node + 1) * ppn])
        for key, value in spec.hyperparameters.items():
            env[f"SM_HP_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
        env["SDP_CHECKPOINT_DIR"] = str(Path(spec.checkpoint_dir).expanduser().absolute()) \
            if spec.checkpoint_dir else os.path.join(job_dir, jobdir.CHECKPOINTS)
        return env

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
            attempt, causes = 0, []
            while True:
                state, error, codes = self._attempt(attempt, started)
                if state == "failed" and attempt < spec.max_restarts and not self._stop.is_set() \
                        and error and not error.startswith("timed out"):
                    attempt += 1
                    for rank in range(self.world_size):
                        self._line(rank, f"[sdp_jupyter] restart {attempt} of {spec.max_restarts} after: "
                                         f"{error.splitlines()[0]}\n")
                    causes.append(error)
                    job._update(restarts=attempt, restart_errors=causes)
                    continue
                break
        except Exception as e:  # our own bug or an OS error: the job fails with it, nothing left running
            state, error = "failed", f"the launcher failed: {type(e).__name__}: {e}"
            self._terminate()
        finally:
            self._stop_samplers()
            for t in self._readers:
                t.join(timeout=2)
            with _ACTIVE_LOCK:
                _ACTIVE.discard(self)
            warm.job_done(self.launcher.warm)
            job._update(state=state, error=error, exit_codes=codes, ended=time.time())

    def _attempt(self, attempt: int, started: float) -> tuple[str, str | None, list]:
        port = free_port()
        script = str(self.job.dir / jobdir.SCRIPT) if self.spec.script is None else self.spec.script
        self._procs, readers = [], []
        exits: queue.Queue = queue.Queue()
        for rank in range(self.world_size):
            env = self.environment(rank, attempt, port)
            env["SDP_SCRIPT"] = script
            proc = self._spawn([sys.executable, "-u", "-m", "sdp_jupyter.launch.worker"], env)
            self._procs.append(proc)
            reader = threading.Thread(target=self._read, args=(rank, proc), daemon=True,
                                      name=f"sdp-{self.job.name}-out{rank}")
            reader.start()
            readers.append(reader)
            self._readers.append(reader)
            threading.Thread(target=lambda r=rank, p=proc: exits.put((r, p.wait())), daemon=True).start()
        self.job._update(state="running", started=self.job.status.get("started") or time.time(),
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
        """A rank's process: forked by the warm pool (launch/warm.py) or started cold; same contract."""
        if warm.wanted(self.launcher.warm):
            proc = warm.start_rank(argv, env)
            if not isinstance(proc, str):
                if self.job.status.get("start") is None:
                    self.job._update(start="warm")
                return proc
            if self.job.status.get("start_reason") is None:  # one cold rank makes the job "cold"
                self.job._update(start="cold", start_reason=f"warm start not possible: {proc}")
        elif self.job.status.get("start") is None:
            self.job._update(start="cold")
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)

    def _failure_message(self, rank: int, code: int) -> str:
        node, local_rank = divmod(rank, self.spec.procs_per_node)
        tail = "".join(self.job.logs(rank, tail=LAST_LINES)).rstrip()
        msg = f"rank {rank} (node {node}, local rank {local_rank}) {describe_exit(code)}"
        if tail:
            msg += f"; its last lines:\n{tail}"
        return msg

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
                    self.job._emit(rank, text)
                elif raw.endswith(b"\n"):
                    cut = False
        proc.stdout.close()

    def _line(self, rank: int, text: str) -> None:
        with jobdir.open_private(jobdir.log_path(self.job.dir, rank), "a") as log:
            log.write(text)
        self.job._emit(rank, text)

    def _terminate(self, codes: list | None = None) -> list:
        """SIGINT every live rank's process group, then SIGTERM, then SIGKILL; return exit codes."""
        procs = self._procs
        for sig, grace in ((signal.SIGINT, self.launcher.sigint_grace),
                           (signal.SIGTERM, self.launcher.sigterm_grace), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.poll() is None]
            if not alive:
                break
            for p in alive:
                _signal_group(p.pid, sig)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(p.poll() is None for p in alive):
                time.sleep(0.02)
        self._cleanup_groups()
        return [p.returncode for p in procs]

    def _cleanup_groups(self) -> None:
        """Kill what a rank left behind in its session (e.g. data-loader workers)."""
        for p in self._procs:
            _signal_group(p.pid, signal.SIGKILL)

    # ------------------------------------------------------------------ per-node samplers
    def _start_samplers(self) -> None:
        if importlib.util.find_spec("sdp_jupyter.monitor.sampler") is None:
            return
        env = dict(os.environ, SDP_LAUNCHER_PID=str(os.getpid()),
                   PYTHONPATH=os.pathsep.join(filter(None, [PACKAGE_PARENT, os.environ.get("PYTHONPATH")])))
        for node in range(self.spec.nodes):
            log = jobdir.open_private(self.job.dir / jobdir.LOGS / f"sampler-node-{node}.log")
            with log:
                self._samplers.append(subprocess.Popen(
                    [sys.executable, "-m", "sdp_jupyter.launch.worker", "--module", "sdp_jupyter.monitor.sampler",
                     "--job-dir", str(self.job.dir), "--node", str(node)],
                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, close_fds=True))

    def _stop_samplers(self) -> None:
        for p in self._samplers:
            if p.poll() is None:
                _signal_group(p.pid, signal.SIGTERM)
        for p in self._samplers:
            try:
                p.wait(timeout=3)
            except subprocess.TimeoutExpired:
                _signal_group(p.pid, signal.SIGKILL)
                p.wait()

    def kill_now(self) -> None:
        """At interpreter exit: no grace, nothing may survive us."""
        self._stop.set()
        for p in self._procs + self._samplers:
            _signal_group(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs + self._samplers):
            time.sleep(0.02)
        for p in self._procs + self._samplers:
            _signal_group(p.pid, signal.SIGKILL)


@atexit.register
def _stop_all_at_exit() -> None:
    with _ACTIVE_LOCK:
        runs = list(_ACTIVE)
    for run in runs:
        run.kill_now()
        try:
            run.job._update(state="stopped", error="the launching process exited", ended=time.time())
        except OSError:
            pass
