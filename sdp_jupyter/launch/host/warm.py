"""Warm starts: a pool server that has imported torch once and forks a fresh process per rank.

`python -m sdp_jupyter.launch.rank.worker` spends seconds importing torch before a line of the job runs.
The pool server (one per kernel and target host) imports torch, torch.optim, torch.distributed,
torch.nn.parallel, torch.fx's symbolic shapes and sdp_jupyter.torch (plus --preload modules) once, and then forks one process
per rank. Each forked rank gets what a cold start gets: its own session (setsid), the launcher's
environment, working directory and sys.argv, a parent-death signal, real pipes for stdout/stderr
(passed over a unix socket with SCM_RIGHTS) and its own exit code; the job's code runs only in the
fork, so nothing it imports or sets reaches the next job.

Safe by construction: the server runs no thread (it checks threading, /proc/self/task and
torch.cuda before every fork and answers "cold: REASON" when anything is off; the launcher then
starts that rank cold), never runs job code itself, dies with its owner (parent-death SIGTERM on the
owning thread, and EOF on its stdin when the owner closes it; either way it kills its ranks and removes
its socket folder) and is replaced when the installed
code changes (fingerprint of sdp_jupyter's files and the torch version).

Server:  python -m sdp_jupyter.launch.host.warm --socket PATH|auto [--preload numpy,sklearn]
Client:  handle_or_reason = fork_rank(socket_path, argv, env, cwd)   # a Popen-like WarmProcess, or a str reason
The kernel's side (which pools it holds, when a job starts warm): launch/kernel/warm_pool.py.

On another host (the SSH and Ray targets) that host's agent forks the job's ranks from the pool with
`fork_rank(..., owned=True)`: a rank whose client (the agent) goes away is killed, so a dead agent
leaves no rank behind.
"""
from __future__ import annotations

import hashlib
import io
import json
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from sdp_jupyter.launch import process
from sdp_jupyter._env import env_str

# Not torch._dynamo, although an optimizer's first step() imports it (1.4 s per rank here): torch with
# _dynamo imported before a gloo DDP model is made can hang at the model's end (the process group's
# destructor joins its worker threads holding the GIL while one of them needs it; with PyTorch's tutorial
# pattern, destroy_process_group() and then the model going out of scope, 3 in 14 warm jobs here and
# 5 in 12 cold ones whose script imported torch._dynamo first). torch.fx's symbolic shapes (sympy among
# them: a third of that import) carry no such risk (16 of 16); importing them starts no thread.
# cloudpickle: notebook code by value (launch/kernel/push.py) is unpickled on the ranks (90 ms to import, cold)
BASE_MODULES = ("torch", "torch.optim", "torch.distributed", "torch.nn.parallel",
                "torch.fx.experimental.symbolic_shapes", "sdp_jupyter.torch", "cloudpickle")
MAX_REQUEST = 4 << 20
READY_TIMEOUT = 120.0
FOLDER_PREFIX = "sdp-warm-"  # the socket folder of a server started with --socket auto, in the temp folder


# ---------------------------------------------------------------------------------------- shared
def fingerprint() -> str:
    """Changes when the installed code changes: sdp_jupyter's files (name, size, mtime) and torch's version."""
    from importlib import metadata

    import sdp_jupyter

    h = hashlib.sha256()
    root = Path(sdp_jupyter.__file__).resolve().parent
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".so") and "__pycache__" not in p.parts:
            st = p.stat()
            h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    try:
        h.update(metadata.version("torch").encode())
    except metadata.PackageNotFoundError:
        h.update(b"no torch")
    h.update(sys.executable.encode())
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------- server
def fork_unsafe_reason() -> str | None:
    """Why forking now would not give a clean process (None: it would)."""
    if threading.active_count() != 1:
        return f"the pool runs {threading.active_count()} Python threads"
    try:
        tasks = len(os.listdir("/proc/self/task"))
    except OSError:
        tasks = 1
    if tasks != 1:
        return f"the pool process has {tasks} OS threads (a library started a thread pool)"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA was initialized in the pool"
    return None


def _blas_threads(env: dict) -> int:
    """The OpenBLAS thread count a cold start with `env` would get (OpenBLAS reads it at load)."""
    for key in ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS"):
        try:
            n = int(env.get(key, "").split(",")[0])
        except ValueError:
            continue
        if n > 0:
            return n
    return os.cpu_count() or 1


def _omp_threads(env: dict) -> int | None:
    try:
        n = int(env.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        return None
    return n if n > 0 else None


def _child(req: dict, fds: list, server_pid: int, closing: list) -> None:
    """In the forked rank: become what `argv` in `env` and `cwd` would have started. Never returns."""
    code = 1
    try:
        for s in closing:
            try:
                s.close()
            except OSError:
                pass
        os.setsid()
        process.expect_parent(server_pid)  # the worker's own arming checks against the pool server
        process.arm_parent_death_signal(signal.SIGKILL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked by the server around fork
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1] if len(fds) > 1 else fds[0], 2)
        for fd in set(fds) | {devnull}:
            if fd > 2:
                os.close(fd)
        env = req["env"]
        os.environ.clear()
        os.environ.update(env)
        os.chdir(req["cwd"] or os.getcwd())
        unbuffered = "-u" in req["flags"] or bool(env.get("PYTHONUNBUFFERED"))
        enc = sys.stdout.encoding if sys.stdout else "utf-8"
        for fd, name in ((1, "stdout"), (2, "stderr")):
            raw = io.FileIO(fd, "w", closefd=False)
            stream = io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=enc,
                                      errors="backslashreplace" if fd == 2 else "strict",
                                      line_buffering=fd == 2 and not unbuffered, write_through=unbuffered)
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        sys.stdin = sys.__stdin__ = open(0, closefd=False)
        # sys.path as a cold `python -m` in this cwd with this PYTHONPATH would have it
        sys.path[:] = [os.getcwd()] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p] \
            + req["base_path"]
        if "threadpoolctl" in sys.modules:
            sys.modules["threadpoolctl"].threadpool_limits(_blas_threads(env), user_api="blas")
        omp = _omp_threads(env)
        if omp and "torch" in sys.modules:
            # libgomp read OMP_NUM_THREADS when the pool loaded it; a cold rank's torch uses the
            # rank's value (setting it starts no thread: the OpenMP team starts at the first op)
            sys.modules["torch"].set_num_threads(omp)
        module, args = req["module"], req["args"]
        if module == "sdp_jupyter.launch.rank.worker":
            from sdp_jupyter.launch.rank import worker

            sys.argv = [worker.__file__] + args
            worker.fast_exit(worker.main())
        import runpy

        sys.argv = [module] + args
        try:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) or e.code is None else 1
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr)
            code = code or 0
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
        try:
            sys.stderr.flush()
        except Exception:
            pass
    os._exit(code)


def serve(sock_path: str, preload: list[str]) -> int:
    """The pool's loop: one thread, select() on the listening socket and stdin, reap with WNOHANG.
    `sock_path` "auto": a socket in a fresh 0700 folder, said in the ready line and removed at the end."""
    # The owner's death (parent-death signal) or a plain kill asks the loop to stop (a flag, not an
    # exception: one raised inside the `finally` would cut its clean-up short); the `finally` kills the
    # ranks and removes the socket and its folder. Forked ranks put SIGTERM back to default.
    signal.signal(signal.SIGTERM, _stop_on_signal)
    process.arm_parent_death_signal(signal.SIGTERM, parent=0)
    owner = env_str("SDP_WARM_OWNER")
    if owner and os.getppid() != int(owner):
        return 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's Ctrl-C is not ours
    made_dir = None
    if sock_path == "auto":
        remove_stale_folders(tempfile.gettempdir())
        made_dir = tempfile.mkdtemp(prefix=FOLDER_PREFIX)
        sock_path = os.path.join(made_dir, "pool.sock")
    conns: dict[int, socket.socket] = {}  # rank pid -> its client's connection
    try:
        return _serve(sock_path, preload, conns)
    finally:
        for pid in list(conns):
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass
        if made_dir:
            for p, remove in ((sock_path, os.unlink), (made_dir, os.rmdir)):
                try:
                    remove(p)
                except OSError:
                    pass


def remove_stale_folders(tmp: str, min_age: float = READY_TIMEOUT) -> list[str]:
    """Remove the socket folders of this user's pool servers that were killed outright, so their own
    exit never ran (SIGKILL: Ray's clean-up of an actor's children, the OOM killer): a folder older
    than `min_age` whose socket no server listens on any more. Returns the folders removed."""
    removed = []
    now = time.time()
    for d in Path(tmp).glob(FOLDER_PREFIX + "*"):
        sock = d / "pool.sock"
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < min_age:
                continue  # not a folder (a link), another user's, or a server still starting (it binds after its imports)
            if os.path.lexists(sock):
                probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                try:
                    probe.settimeout(1.0)
                    probe.connect(str(sock))
                    continue  # a live server (it answers the empty request with a reason, and goes on)
                except ConnectionRefusedError:
                    pass
                except OSError:
                    continue
                finally:
                    probe.close()
                sock.unlink()
            d.rmdir()
            removed.append(str(d))
        except OSError:
            continue
    return removed


_STOP = [False]  # set by SIGTERM: the loop ends at its next turn (within 20 ms)


def _stop_on_signal(signum, frame):
    _STOP[0] = True


def _serve(sock_path: str, preload: list[str], conns: dict) -> int:
    import importlib

    failed = []
    for name in list(BASE_MODULES) + preload:
        try:
            importlib.import_module(name)
        except Exception as e:
            failed.append(f"{name}: {type(e).__name__}: {e}")
    try:  # sets each rank's OpenBLAS threads as its cold start would have them
        importlib.import_module("threadpoolctl")
    except ImportError:
        pass
    base_path = [p for p in sys.path if p and p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                 and p != os.getcwd()]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sock_path)
    listener.listen(64)
    reason = fork_unsafe_reason()
    print(json.dumps({"ready": True, "pid": os.getpid(), "fingerprint": fingerprint(), "socket": sock_path,
                      "unsafe": reason, "preload_failed": failed}), flush=True)
    owned: set[int] = set()               # ranks killed when their client goes away (an agent's)
    stdin = sys.stdin.buffer
    try:
        while not _STOP[0]:
            watched = [c for c in conns.values() if c.fileno() >= 0]
            r, _, _ = select.select([listener, stdin] + watched, [], [], 0.02)
            if stdin in r and not os.read(0, 4096):
                return 0  # the owner closed our stdin: it is gone or done with us
            for pid, c in list(conns.items()):
                if c in r:
                    try:
                        data = c.recv(1)
                    except OSError:
                        data = b""
                    if not data:  # the client went away: an owned rank goes with it, another runs on
                        c.close()
                        if pid in owned:
                            try:
                                os.killpg(pid, signal.SIGKILL)
                            except OSError:
                                pass
            if listener in r:
                _accept(listener, conns, owned, base_path, stdin)
            while conns:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                owned.discard(pid)
                c = conns.pop(pid, None)
                if c is not None and c.fileno() >= 0:
                    try:
                        c.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
                    except OSError:
                        pass
                    c.close()
        return 0  # SIGTERM
    finally:
        listener.close()


def _accept(listener, conns, owned, base_path, stdin) -> None:
    conn, _ = listener.accept()
    fds: list = []
    try:
        msg, fds, _, _ = socket.recv_fds(conn, MAX_REQUEST, 2)
        req = json.loads(msg)
        req["base_path"] = base_path
        reason = fork_unsafe_reason()
        if reason:
            conn.send(json.dumps({"cold": reason}).encode())
            conn.close()
            return
        # SIGTERM waits until the child has put it back to default: in between, the server's handler
        # would only set the child's copy of the stop flag, and the rank would outlive the signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            pid = os.fork()
            if pid == 0:
                _child(req, fds, os.getppid(), [listener, conn, stdin] + [c for c in conns.values() if c.fileno() >= 0])
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        conn.send(json.dumps({"pid": pid}).encode())
        conns[pid] = conn
        if req.get("owned"):
            owned.add(pid)
    except Exception as e:  # a bad request never takes the pool down
        try:
            conn.send(json.dumps({"cold": f"the pool could not start it: {type(e).__name__}: {e}"}).encode())
        except OSError:
            pass
        conn.close()
    finally:
        for fd in fds:
            os.close(fd)


# ---------------------------------------------------------------------------------------- client
class WarmProcess:
    """What subprocess.Popen gives the launcher, for a rank forked by the pool."""

    def __init__(self, conn: socket.socket, pid: int, args: list, stdout):
        self._conn = conn
        self._lock = threading.Lock()
        self.pid = pid
        self.args = args
        self.stdout = stdout
        self.stdin = self.stderr = None
        self.returncode: int | None = None
        self.warm = True

    def _receive(self, timeout: float | None) -> None:
        """Take the rank's exit status if the server sent it, waiting up to `timeout` for it. The wait is
        outside the lock: a waiter holding it through a blocking recv, again and again, starved the
        other threads' poll() (stop took 6.5-150 s instead of its grace periods)."""
        if timeout is None or timeout > 0:
            try:
                select.select([self._conn], [], [], timeout)
            except (ValueError, OSError):
                pass  # closed by another thread, which took the status
        with self._lock:
            if self.returncode is not None:
                return
            self._conn.settimeout(0.0)
            try:
                data = self._conn.recv(4096)
            except (socket.timeout, BlockingIOError):
                return
            except OSError:
                data = b""
            # EOF without a status: the pool died, and the rank with it (parent-death signal)
            self.returncode = json.loads(data)["exit"] if data else -signal.SIGKILL
            self._conn.close()

    def poll(self) -> int | None:
        self._receive(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._receive(0.2 if left is None else min(left, 0.2))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def module_argv(argv: list):
    """(interpreter flags, ["-m", MODULE, ARGS...]) of `python [-u] -m MODULE ARGS...` run by this
    interpreter, or why argv cannot start warm."""
    flags, rest = [], list(argv[1:])
    while rest and rest[0] in ("-u",):
        flags.append(rest.pop(0))
    if os.path.realpath(argv[0]) != os.path.realpath(sys.executable) or len(rest) < 2 or rest[0] != "-m":
        return "only `python [-u] -m MODULE` starts warm"
    return flags, rest


def fork_rank(path: str, argv: list, env: dict, cwd: str | None = None, owned: bool = False):
    """Ask the pool server at socket `path` to run argv (`python [-u] -m MODULE ARGS...`): a
    WarmProcess, or a one-line reason why the rank must start cold. `owned`: the server kills the
    rank when this process's handle goes away (an agent that dies takes its ranks with it)."""
    parsed = module_argv(argv)
    if isinstance(parsed, str):
        return parsed
    flags, rest = parsed
    r, w = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.connect(path)
        req = {"module": rest[1], "args": rest[2:], "flags": flags, "env": dict(env),
               "cwd": os.path.abspath(cwd or os.getcwd()), "owned": owned}
        socket.send_fds(conn, [json.dumps(req).encode()], [w])
        os.close(w)
        w = -1
        answer = conn.recv(4096)
        reply = json.loads(answer) if answer else {"cold": "the pool server closed the connection"}
    except OSError as e:
        reply = {"cold": f"the pool server did not answer ({e})"}
    finally:
        if w >= 0:
            os.close(w)
    if "pid" not in reply:
        conn.close()
        os.close(r)
        return reply.get("cold", "the pool server refused")
    return WarmProcess(conn, reply["pid"], list(argv), os.fdopen(r, "rb"))


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m sdp_jupyter.launch.host.warm")
    p.add_argument("--socket", required=True,
                   help="the unix socket path to listen on; auto: a socket in a fresh 0700 folder, named in "
                        "the ready line and removed when the pool ends")
    p.add_argument("--preload", default="",
                   help="comma-separated modules to import too, after torch and sdp_jupyter.torch "
                        "(e.g. numpy,sklearn)")
    a = p.parse_args(argv)
    return serve(a.socket, [m for m in a.preload.split(",") if m.strip()])


if __name__ == "__main__":
    sys.exit(main())
