"""The kernel's warm pools (launch/host/warm.py is the server): which pools this process holds, and
whether a job starts warm.

`warm_up()` starts (or reuses) this host's pool; `held_pool(key, opener)` keeps another host's, one
per key (an ssh client or a Ray actor running the server with `--socket auto`; its ready line says
where the socket is), for as long as this process lives. `wanted()` and `job_done()` are the policy:
a kernel's first job is cold, the pool starts after it, and the next job forks its ranks from it.
"""
from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import threading

from sdp_jupyter.launch import process
from sdp_jupyter.launch.host.warm import READY_TIMEOUT, fingerprint, fork_rank, module_argv
from sdp_jupyter._env import env_str


class Pool:
    """One pool server: this host's (the local target), or, with `opener`, another host's, reached
    through a channel process that `opener(server_args)` starts (an ssh client) and whose stdin we hold.
    Started by a thread that lives as long as the server, so its parent-death signal fires when this
    process dies, not when a job ends."""

    def __init__(self, preload: list[str] | None = None, opener=None):
        self.preload = sorted(set(preload or []))
        self.opener = opener
        self.path = ""  # the server's socket, in a 0700 folder it makes and removes: from its ready line
        self.info: dict = {}
        self.proc: subprocess.Popen | None = None
        self._ready = threading.Event()
        self._error: str | None = None
        self._owner = threading.Thread(target=self._own, name="sdp-warm-pool", daemon=True)
        self._owner.start()

    def _own(self) -> None:
        # the rank's own PYTHONPATH, as ranks.environment makes it
        env = dict(os.environ, PYTHONPATH=process.rank_pythonpath(os.environ.get("PYTHONPATH")), SDP_WARM_OWNER=str(os.getpid()),
                   OPENBLAS_NUM_THREADS="1")  # OpenBLAS would start its thread pool at import
        try:
            server_args = ["--socket", "auto", "--preload", ",".join(self.preload)]
            if self.opener is not None:
                self.proc = self.opener(server_args)
            else:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "sdp_jupyter.launch.host.warm", *server_args],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    start_new_session=True, close_fds=True)
            line = self.proc.stdout.readline()
            while line and not line.startswith(b"{"):  # a login shell's greeting on another host
                line = self.proc.stdout.readline()
            self.info = json.loads(line) if line else {}
            self.path = self.info.get("socket", "")
            if not self.info.get("ready"):
                self._error = f"the pool server exited ({self.proc.wait()}) before it was ready"
        except Exception as e:
            self._error = f"the pool server could not start: {type(e).__name__}: {e}"
        self._ready.set()
        if self.proc is not None and self.opener is None:  # a channel process is not ours to wait on
            self.proc.wait()

    def ready(self, timeout: float = READY_TIMEOUT) -> str | None:
        """Wait for the server; None when it can fork ranks, else why not (one line)."""
        if not self._ready.wait(timeout):
            return "the pool server is still starting"
        if self._error:
            return self._error
        if self.proc.poll() is not None:
            return f"the pool server exited ({self.proc.returncode})"
        return self.info.get("unsafe")

    def alive(self) -> bool:
        return self._ready.is_set() and self.proc is not None and self.proc.poll() is None

    def start(self, argv: list, env: dict, cwd: str | None = None):
        """A WarmProcess running argv (`python [-u] -m MODULE ARGS...`), or a one-line reason for a cold start."""
        parsed = module_argv(argv)
        if isinstance(parsed, str):
            return parsed
        return self.ready() or fork_rank(self.path, argv, env, cwd)

    def started(self) -> bool:
        """The server is ready, or failed to be: ready() answers at once."""
        return self._ready.is_set()

    def address(self, timeout: float = READY_TIMEOUT) -> tuple[dict | None, str | None]:
        """For an agent on the pool's host: ({"socket", "fingerprint"}, None) once the server is
        ready (waiting up to `timeout`), else (None, why it is not usable)."""
        reason = self.ready(timeout)
        if reason:
            return None, reason
        return {"socket": self.path, "fingerprint": self.info.get("fingerprint")}, None

    def close(self) -> None:
        """Stop the server (EOF on its stdin; then SIGTERM; SIGKILL last). It removes its own socket."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=3)
            except (OSError, subprocess.TimeoutExpired):
                try:
                    self.proc.terminate()
                    self.proc.wait(timeout=3)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()


_POOL: Pool | None = None
_POOL_LOCK = threading.Lock()
_PRELOAD: set[str] = set()
_HELD: dict = {}  # key (target, host, ...) -> another host's Pool, held by this process

# An optimizer's first step() imports torch._dynamo (torch._disable_dynamo's first call): 1.4-2.3 s a rank
# on 2 cores, most of the quickstart's warm cell (3.6 s without it in the pool, 1.4 s with). It is
# preloaded for smddp jobs only: with torch._dynamo imported before a gloo DistributedDataParallel model is
# made, torch's gloo process group can hang in its destructor at the model's end (docs/warm.md). A gloo or
# nccl job whose pool holds it starts cold, saying why.
DYNAMO = "torch._dynamo"
DYNAMO_BACKENDS = ("smddp",)


def job_preload(spec) -> list[str]:
    """What a job's pool imports: its --preload modules, and torch._dynamo for an smddp job."""
    return list(spec.preload) + ([DYNAMO] if spec.backend in DYNAMO_BACKENDS else [])


def refusal(pool: "Pool", backend: str) -> str | None:
    """Why a job on `backend` must not fork its ranks from `pool` (which preloaded torch._dynamo), or None."""
    if DYNAMO in pool.preload and backend not in DYNAMO_BACKENDS:
        return (f"this kernel's warm pool preloaded {DYNAMO} for its smddp jobs, and a {backend} "
                "DistributedDataParallel model made after that import can hang at its end (docs/warm.md)")
    return None


def warm_up(preload: list[str] | tuple = ()) -> Pool:
    """Start (or reuse) this process's pool, replacing it if the code changed or new modules are named."""
    global _POOL
    with _POOL_LOCK:
        _PRELOAD.update(m for m in preload if m)
        pool = _POOL
        if pool is not None and pool.alive() and pool.info.get("fingerprint") != fingerprint():
            pool.close()
            pool = None
        if pool is not None and (not set(_PRELOAD) <= set(pool.preload)
                                 or (pool.started() and not pool.alive())):
            pool.close()
            pool = None
        if pool is None:
            pool = _POOL = Pool(sorted(_PRELOAD))
        return pool


def held_pool(key: tuple, opener, preload: list[str] | tuple = ()) -> Pool:
    """Start (or reuse) the pool of another host, one per `key`; replaced when it died or when new
    modules are named (its code is checked by the agent there: see discard)."""
    with _POOL_LOCK:
        _PRELOAD.update(m for m in preload if m)
        pool = _HELD.get(key)
        if pool is not None and (not set(_PRELOAD) <= set(pool.preload)
                                 or (pool.started() and not pool.alive())):
            pool.close()
            pool = None
        if pool is None:
            pool = _HELD[key] = Pool(sorted(_PRELOAD), opener=opener)
        return pool


def discard(key: tuple) -> None:
    """Close another host's pool (its agent found the installed code changed): the next job starts a new one."""
    with _POOL_LOCK:
        pool = _HELD.pop(key, None)
    if pool is not None:
        pool.close()


def _env_choice() -> bool | None:
    """SDP_WARM=1 / 0 when set (it overrides the default, not an explicit --warm/--cold), else None."""
    if not env_str("SDP_WARM", "").strip():
        return None
    from sdp_jupyter._env import env_bool

    return env_bool("SDP_WARM", False)


def wanted(choice: bool | None, key: tuple | None = None) -> bool:
    """Start this job's ranks warm? True/False as asked (--warm/--cold, LocalLauncher(warm=...));
    else SDP_WARM=1/0; else warm when this process has a pool: one started after an earlier job of
    this kernel (job_done), or asked for with %sdp_warm / warm_up(). So a kernel's first job is cold,
    and outside a kernel jobs are cold unless asked. `key`: another host's pool (held_pool) instead
    of this host's."""
    if choice is not None:
        return choice
    env = _env_choice()
    return env if env is not None else (_POOL is not None if key is None else key in _HELD)


def _in_kernel() -> bool:
    """True inside a Jupyter kernel (not a terminal IPython, not a plain script)."""
    ipython = sys.modules.get("IPython")
    shell = ipython is not None and getattr(ipython, "get_ipython", lambda: None)()
    return bool(shell) and getattr(shell, "kernel", None) is not None


def job_done(choice: bool | None, preload: list[str] | tuple = (), start=None) -> None:
    """After a job: start the pool for the next one (after, not during: the first job keeps the CPUs).
    In a Jupyter kernel that is the default (the kernel's next job starts warm); elsewhere only when
    asked (--warm, SDP_WARM=1). Never after --cold or with SDP_WARM=0. `start(preload)`: what starts
    the pool(s) (another target's hosts'), this host's by default."""
    if choice is False:
        return
    env = _env_choice()
    if choice or env or (env is None and _in_kernel()):
        try:
            (start or warm_up)(preload)
        except Exception:  # e.g. no temporary directory: the next job starts cold, with the reason
            pass


def start_rank(argv: list, env: dict, cwd: str | None = None, preload: list[str] | tuple = ()):
    """The launcher's hook: a WarmProcess (Popen-like: pid, poll, wait, send_signal, stdout with
    stderr merged), or a one-line reason why this rank must start cold."""
    return warm_up(preload).start(argv, env, cwd)


@atexit.register
def shutdown() -> None:
    """Close every pool this process holds; the next starts from the modules its job names."""
    global _POOL
    with _POOL_LOCK:
        pools = [_POOL] + list(_HELD.values())
        _POOL = None
        _HELD.clear()
        _PRELOAD.clear()
    for pool in pools:
        if pool is not None:
            pool.close()
