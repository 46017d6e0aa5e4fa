"""The SSH target: `%%sdp_train --target ssh --hosts gpu1,gpu2` runs the cell on your own machines.

One OpenSSH client per host (`ssh -T`, BatchMode: the user's ~/.ssh/config, keys and jump hosts
apply, and nothing ever prompts) runs the per-host agent (launch/agent.py) and talks to it over the
connection's stdin/stdout. Before anything starts every host is checked at once: reachable, the
interpreter runs, sdp_jupyter imports at this version, GPUs enough for nccl. The job's files and its
secret travel in the `start` frame, never on a command line or in a file another user can read.

The notebook side mirrors the job directory (status, per-rank logs, metrics, result), so the job
view, the dashboard and `Job.open` work as for a local job. A host that stops answering for
HEARTBEAT_TIMEOUT seconds (a cut link, a dead host) fails the job naming it; the other hosts' agents
stop their ranks at once. If the notebook dies, its ssh clients die with it (parent-death signal), the
agents see their channel close and stop their ranks; an agent also stops them on its own when the
launcher's heartbeats stop. See docs/ssh.md.
"""
from __future__ import annotations

import collections
import ctypes
import os
import queue
import re
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from sdp_jupyter.launch import agent as channel
from sdp_jupyter.launch import jobdir, supervise
from sdp_jupyter.launch.job import Job
from sdp_jupyter.launch.ranks import describe_exit
from sdp_jupyter.launch.spec import JobSpec, Option, SpecError

CONNECT_TIMEOUT = 10       # seconds for ssh to connect (ConnectTimeout)
HELLO_TIMEOUT = 30         # seconds from starting ssh to the agent's hello (connect + interpreter start)
HEARTBEAT_TIMEOUT = 10.0   # a host silent this long is lost (the agent pings every second)
LAST_LINES = 12
CONNECTED = "sdp-agent-connected"

SSH_OPTIONS = (
    Option("--hosts", "ssh.hosts", "--target ssh: host names, as `ssh HOST` reaches them (user@host works)",
           kind="csv", metavar="H1,H2"),
    Option("--hostfile", "ssh.hostfile", '--target ssh: a DeepSpeed-style host file ("gpu1 slots=8" per line)',
           metavar="FILE"),
    Option("--python", "ssh.python", "--target ssh: the interpreter on the hosts (default: this one's path)",
           metavar="PATH"),
    Option("--ssh-config", "ssh.config", "--target ssh: an ssh_config file for these hosts (ssh -F)",
           metavar="FILE"),
)
KEYS = {"hosts", "hostfile", "python", "config"}
_HOST_RE = re.compile(r"^(?:[A-Za-z0-9_.-]+@)?[A-Za-z0-9_][A-Za-z0-9_.:-]*$")



def _check_host(host: str, where: str) -> str:
    host = host.strip()
    if not _HOST_RE.match(host):  # never an option to ssh ("-oProxyCommand=..."), never a shell word
        raise SpecError(where, f"{host!r} is not a host name (letters, digits, '.', '-', '_', an optional "
                               "user@). Fix: --hosts gpu1,gpu2")
    return host


def read_hostfile(path: str) -> list[tuple[str, int | None]]:
    """DeepSpeed's host file: `host [slots=N]` per line, `#` comments. [(host, slots or None)]."""
    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise SpecError("--hostfile", f"cannot read {path}: {e.strerror or e}") from None
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        slots = None
        for word in words[1:]:
            key, _, value = word.partition("=")
            if key != "slots" or not value.isdigit() or int(value) < 1:
                raise SpecError("--hostfile", f"{path}, line {number}: {word!r} is not slots=N. "
                                              'Fix: lines like "gpu1 slots=8"')
            slots = int(value)
        rows.append((_check_host(words[0], "--hostfile"), slots))
    if not rows:
        raise SpecError("--hostfile", f"{path} names no host. Fix: one host per line, e.g. \"gpu1 slots=8\"")
    return rows


def hosts_of(spec: JobSpec) -> tuple[list[str], int | None]:
    """The spec's hosts and the slots its host file gives each (None without one)."""
    options = spec.ssh or {}
    unknown = sorted(set(options) - KEYS)
    if unknown:
        raise SpecError("ssh", f"unknown SSH option(s) {', '.join(unknown)}; known: {', '.join(sorted(KEYS))}")
    listed, filed = options.get("hosts"), options.get("hostfile")
    if listed and filed:
        raise SpecError("--hosts", "give --hosts or --hostfile, not both")
    if filed:
        rows = read_hostfile(filed)
        slots = {s for _, s in rows if s is not None}
        if len(slots) > 1 and spec.procs_per_node is None:
            raise SpecError("--hostfile", f"hosts have different slots ({', '.join(map(str, sorted(slots)))}); "
                                          "every node runs the same number of ranks. Fix: --procs-per-node N")
        return [h for h, _ in rows], (slots.pop() if len(slots) == 1 else None)
    if isinstance(listed, str):
        listed = listed.split(",")
    hosts = [_check_host(h, "--hosts") for h in listed or [] if str(h).strip()]
    if not hosts:
        raise SpecError("--hosts", "--target ssh needs the hosts. Fix: --hosts gpu1,gpu2 or --hostfile hosts.txt")
    return hosts, None


def ssh_command(host: str, spec: JobSpec) -> list[str]:
    options = spec.ssh or {}
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
            "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]
    if options.get("config"):
        argv += ["-F", str(Path(options["config"]).expanduser())]
    python = options.get("python") or sys.executable
    # the marker on stderr says "connected and authenticated" before the interpreter starts, so an
    # unreachable host is told apart from a slow interpreter
    return argv + [host, f"echo {CONNECTED} >&2; exec {shlex.quote(python)} -m sdp_jupyter.launch.agent"]


def _die_with_parent() -> None:
    """In the ssh child: SIGTERM when the thread that started it ends (the notebook died)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


_KEEPER: queue.Queue | None = None
_KEEPER_LOCK = threading.Lock()


def _start_ssh(argv: list[str]) -> subprocess.Popen:
    """Start an ssh client from one thread that lives as long as this process: the parent-death
    signal fires when the *thread* that forked a child ends, so a client started from a short-lived
    thread (a widget callback, a pool) would be killed with it."""
    global _KEEPER
    with _KEEPER_LOCK:
        if _KEEPER is None:
            _KEEPER = queue.Queue()

            def keep(inbox: queue.Queue) -> None:
                while True:
                    argv, reply = inbox.get()
                    try:
                        reply.put(subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                   stderr=subprocess.PIPE, start_new_session=True,
                                                   close_fds=True, preexec_fn=_die_with_parent))
                    except Exception as e:  # handed to the caller
                        reply.put(e)

            threading.Thread(target=keep, args=(_KEEPER,), daemon=True, name="sdp-ssh-keeper").start()
    reply: queue.Queue = queue.Queue()
    _KEEPER.put((argv, reply))
    proc = reply.get()
    if isinstance(proc, Exception):
        if isinstance(proc, FileNotFoundError):
            raise SpecError("--target", "the OpenSSH client (`ssh`) is not installed here. "
                                        "Fix: apt-get install openssh-client") from None
        raise proc
    return proc


class Connection:
    """One host's ssh client running its agent; frames land in the run's queue as (node, message)."""

    def __init__(self, node: int, host: str, spec: JobSpec, inbox: queue.Queue):
        self.node, self.host = node, host
        self.hello: dict | None = None
        self.last_heard = time.monotonic()
        self.stderr = collections.deque(maxlen=40)
        self.connected = threading.Event()
        self._send_lock = threading.Lock()
        self.proc = _start_ssh(ssh_command(host, spec))
        self._inbox = inbox
        threading.Thread(target=self._read, daemon=True, name=f"sdp-ssh-{host}").start()
        self._err_thread = threading.Thread(target=self._read_stderr, daemon=True, name=f"sdp-ssh-err-{host}")
        self._err_thread.start()

    def _read(self) -> None:
        why = "the ssh connection closed"
        try:
            while True:
                message = channel.decode(self.proc.stdout)
                self.last_heard = time.monotonic()
                self._inbox.put((self.node, message))
        except channel.ChannelClosed:
            pass
        except ValueError as e:
            why = f"the agent sent a bad frame ({e})"
        code = self.proc.wait()
        self._err_thread.join(timeout=2)
        self._inbox.put((self.node, {"type": "eof", "why": why, "code": code}))

    def _read_stderr(self) -> None:
        for raw in iter(self.proc.stderr.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip()
            if line == CONNECTED and not self.connected.is_set():
                self.connected.set()
            else:
                self.stderr.append(line)

    def send(self, message: dict) -> bool:
        with self._send_lock:
            try:
                self.proc.stdin.write(channel.encode(message))
                self.proc.stdin.flush()
                return True
            except (BrokenPipeError, OSError, ValueError):
                return False

    def close(self, wait: float = 5.0) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def diagnose(self, code: int | None, python: str) -> str:
        """What went wrong before the agent said hello, and the fix."""
        said = " ".join(line for line in self.stderr if line)[-400:]
        if "No module named" in said and "sdp_jupyter" in said:
            return (f"sdp_jupyter is not installed for {python} there. Fix: pip install "
                    f"sdp_jupyter=={channel.version()} on {self.host}, or --python <its interpreter>")
        if code == 127 or "No such file" in said or "not found" in said:
            return f"{python} does not run there ({said or 'exit 127'}). Fix: --python <the interpreter on the host>"
        if code == 255:
            return (f"ssh cannot reach it ({said or 'exit 255'}). Fix: make `ssh -o BatchMode=yes {self.host} true` "
                    "work from this machine (host name, key, known_hosts, ~/.ssh/config)")
        return f"the agent did not start (exit {code}: {said or 'no output'})"


class SSHLauncher:
    """Runs a JobSpec on SSH hosts, one node per host. Grace periods (seconds) apply when stopping."""

    def __init__(self, sigint_grace: float = 3.0, sigterm_grace: float = 2.0):
        self.sigint_grace = sigint_grace
        self.sigterm_grace = sigterm_grace

    def resolve(self, spec: JobSpec) -> tuple[JobSpec, list[str], int | None]:
        hosts, slots = hosts_of(spec)
        nodes = len(hosts) if spec.nodes == 1 else spec.nodes  # --nodes defaults to the number of hosts
        if nodes > len(hosts):
            raise SpecError("--nodes", f"{nodes} nodes but {len(hosts)} host(s) ({', '.join(hosts)}). "
                                       f"Fix: --nodes {len(hosts)}, or name more hosts")
        if spec.script is not None and not Path(spec.script).is_file():
            raise SpecError("script", f"{spec.script} does not exist; give the path of a .py file")
        spec = spec.replace(name=spec.name or jobdir.new_job_name(), nodes=nodes,
                            procs_per_node=spec.procs_per_node or slots)
        return spec, hosts[:nodes], slots

    def start(self, spec: JobSpec, push: dict | None = None) -> Job:
        from sdp_jupyter.launch.local import pickle_push

        spec, hosts, _ = self.resolve(spec)
        push_bytes = pickle_push(spec.push, push or {})
        run = SSHRun(spec, hosts, self)
        try:
            spec = run.preflight()
            job_dir, spec = Job.create_dir(spec, push_bytes)
        except BaseException:
            run.close_all()
            raise
        job = Job(spec, job_dir)
        job._update(state="pending", created=time.time(), started=None, ended=None, exit_codes=[], restarts=0,
                    error=None, launcher_pid=os.getpid(), target="ssh", hosts=hosts,
                    host_names=[c.hello.get("hostname") for c in run.conns],
                    world_size=spec.nodes * spec.procs_per_node)
        run.attach(job, push_bytes)
        job._run = run
        run.start()
        return job


class SSHRun(supervise.Run):
    """The supervisor of one SSH job: its connections, attempts, restarts and stop."""

    def __init__(self, spec: JobSpec, hosts: list[str], launcher: SSHLauncher):
        self.spec, self.hosts, self.launcher = spec, hosts, launcher
        self.inbox: queue.Queue = queue.Queue()
        self.conns: list[Connection] = []
        self.secret = secrets.token_hex(32)
        self.job: Job | None = None
        self.push_bytes: bytes | None = None
        self._logs: dict[int, object] = {}
        supervise.Run.__init__(self, f"sdp-ssh-{spec.name}")

    # ---------------------------------------------------------------- before the job exists
    def preflight(self) -> JobSpec:
        """Start every host's agent at once and check its hello; one SpecError naming every bad host."""
        spec = self.spec
        # every client starts at once (Popen returns before ssh connects); the hellos are awaited together
        self.conns = [Connection(node, host, spec, self.inbox) for node, host in enumerate(self.hosts)]
        python = (spec.ssh or {}).get("python") or sys.executable
        problems: dict[int, str] = {}
        waiting = set(range(len(self.conns)))
        deadline = time.monotonic() + HELLO_TIMEOUT
        connect_by = time.monotonic() + CONNECT_TIMEOUT + 2
        while waiting and time.monotonic() < deadline:
            if time.monotonic() > connect_by:
                for node in [n for n in waiting if not self.conns[n].connected.is_set()]:
                    problems[node] = (f"not reachable within {CONNECT_TIMEOUT} s (ssh is still connecting: a host "
                                      f"that is down, a name that does not resolve, a firewall?). Fix: make "
                                      f"`ssh -o BatchMode=yes {self.hosts[node]} true` work from this machine")
                    waiting.discard(node)
            try:
                node, message = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            if node not in waiting:
                continue
            conn = self.conns[node]
            if message["type"] == "hello":
                conn.hello = message
                waiting.discard(node)
            elif message["type"] == "eof":
                problems[node] = conn.diagnose(message.get("code"), python)
                waiting.discard(node)
        for node in waiting:
            problems[node] = (f"connected, but the agent did not start within {HELLO_TIMEOUT} s "
                              f"({'; '.join(self.conns[node].stderr) or 'no output'})")
        ours = channel.version()
        for conn in self.conns:
            if conn.hello is None or conn.node in problems:
                continue
            if conn.hello.get("version") != ours:
                problems[conn.node] = (f"it has sdp_jupyter {conn.hello.get('version')}, this notebook {ours}. "
                                       f"Fix: pip install sdp_jupyter=={ours} there")
        ppn = spec.procs_per_node
        if ppn is None:  # GPUs per host, as locally; 1 on CPU-only hosts
            ppn = min((max(1, int(c.hello.get("gpus") or 0)) for c in self.conns if c.hello), default=1)
        if spec.backend == "nccl":
            for conn in self.conns:
                if conn.hello and conn.node not in problems and int(conn.hello.get("gpus") or 0) < ppn:
                    problems[conn.node] = (f"it has {conn.hello.get('gpus') or 0} GPU(s) and nccl needs one per "
                                           f"process ({ppn}). Fix: --procs-per-node {conn.hello.get('gpus') or 0} "
                                           "or --backend smddp")
        if problems:
            lines = "\n".join(f"  {self.hosts[n]}: {problems[n]}" for n in sorted(problems))
            raise SpecError("--hosts", f"{len(problems)} of {len(self.hosts)} host(s) cannot run the job; "
                                       f"nothing was started:\n{lines}")
        self.spec = spec.replace(procs_per_node=ppn)
        return self.spec

    def attach(self, job: Job, push_bytes: bytes | None) -> None:
        self.job, self.spec, self.push_bytes = job, job.spec, push_bytes

    def close_all(self) -> None:
        for conn in self.conns:
            conn.send({"type": "bye"})
        for conn in self.conns:
            conn.close()

    # ---------------------------------------------------------------- the job
    def _supervise(self) -> None:
        job, spec = self.job, self.spec
        state, error, codes = "failed", None, []
        try:
            def announce(text: str) -> None:
                for rank in range(spec.nodes * spec.procs_per_node):
                    self._out(rank, text)

            # a lost host is not restarted onto: the job names it and ends
            state, error, codes = supervise.with_restarts(job, self._attempt, announce, self._stop,
                                                          final=("timed out", "host "))
        except Exception as e:  # our own bug or an OS error: the job fails with it, nothing left running
            state, error = "failed", f"the launcher failed: {type(e).__name__}: {e}"
        finally:
            self.close_all()
            for log in self._logs.values():
                log.close()
            self._write_agent_logs()
            supervise.unregister(self)
            job._update(state=state, error=error, exit_codes=codes, ended=time.time())

    def _attempt(self, attempt: int) -> tuple[str, str | None, list]:
        spec, job = self.spec, self.job
        world = spec.nodes * spec.procs_per_node
        first = self.conns[0]
        port = self._ask_port(first)
        script = channel.b64((job.dir / jobdir.SCRIPT).read_bytes())
        for conn in self.conns:
            conn.send({"type": "start", "spec": spec.to_dict(), "node": conn.node, "secret": self.secret,
                       "master_addr": first.hello["addr"], "master_port": port, "attempt": attempt,
                       "script": script, "push": channel.b64(self.push_bytes),
                       "heartbeat_timeout": HEARTBEAT_TIMEOUT})
        job._update(state="running", started=job.status.get("started") or time.time(), port=port,
                    master_addr=first.hello["addr"])
        started = time.monotonic()
        codes: list = [None] * world
        done: set[int] = set()
        failure: str | None = None
        next_ping = 0.0
        while len(done) < len(self.conns):
            now = time.monotonic()
            if now >= next_ping:
                for conn in self.conns:
                    conn.send({"type": "ping"})
                next_ping = now + channel.HEARTBEAT_EVERY
                for conn in self.conns:
                    if conn.node not in done and now - conn.last_heard > HEARTBEAT_TIMEOUT:
                        done.add(conn.node)  # lost: nobody to wait for there (its agent stops its own ranks)
                        return self._fail(f"host {conn.host} (node {conn.node}) has not answered for "
                                          f"{HEARTBEAT_TIMEOUT:g} s: its link or the host is down", codes, done)
            if self._stop.is_set():
                self._stop_all(done)
                return "stopped", self._stop_reason, codes
            if spec.timeout and now - started > spec.timeout and failure is None:
                return self._fail(f"timed out after {spec.timeout:g} s (--timeout)", codes, done)
            try:
                node, message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            kind = message["type"]
            if self._mirror(message):
                continue
            if kind == "exit":
                rank, code = int(message["rank"]), int(message["code"])
                codes[rank] = code
                if code != 0 and failure is None:
                    failure = self._failure_message(rank, code)
                    return self._fail(failure, codes, done)
            elif kind == "result":
                jobdir.write_private(job.dir / jobdir.RESULT, channel.unb64(message["data"]))
            elif kind == "done":
                done.add(node)
            elif kind == "error":
                return self._fail(f"host {self.hosts[node]} (node {node}): {message.get('message')}", codes, done)
            elif kind == "eof":
                conn = self.conns[node]
                done.add(node)
                said = "; ".join(line for line in list(conn.stderr)[-3:] if line)
                return self._fail(f"host {conn.host} (node {node}): {message['why']} (ssh exit {message['code']}"
                                  f"{': ' + said if said else ''})", codes, done)
        return "succeeded", None, codes

    def _ask_port(self, conn: Connection) -> int:
        conn.send({"type": "port"})
        deadline = time.monotonic() + HEARTBEAT_TIMEOUT
        held = []
        try:
            while time.monotonic() < deadline:
                try:
                    node, message = self.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                if node == conn.node and message["type"] == "port":
                    return int(message["port"])
                if message["type"] == "eof":
                    raise RuntimeError(f"host {self.hosts[node]} (node {node}): {message['why']}")
                if message["type"] != "ping":
                    held.append((node, message))
        finally:
            for item in held:
                self.inbox.put(item)
        raise RuntimeError(f"host {conn.host} did not give a port within {HEARTBEAT_TIMEOUT:g} s")

    def _fail(self, error: str, codes: list, done: set) -> tuple[str, str, list]:
        self._stop_all(done)
        return "failed", error, codes

    def _stop_all(self, done: set) -> None:
        """Every agent stops its ranks; wait (bounded) until each says done, keeping their last output."""
        g1, g2 = self.launcher.sigint_grace, self.launcher.sigterm_grace
        for conn in self.conns:
            if conn.node not in done:
                conn.send({"type": "stop", "sigint_grace": g1, "sigterm_grace": g2})
        deadline = time.monotonic() + g1 + g2 + 8
        while time.monotonic() < deadline and len(done) < len(self.conns):
            try:
                node, message = self.inbox.get(timeout=0.1)
            except queue.Empty:
                continue
            if not self._mirror(message) and message["type"] in ("done", "eof"):
                done.add(node)

    # ---------------------------------------------------------------- mirroring into the job directory
    def _mirror(self, message: dict) -> bool:
        """Output and metrics go into the job directory and the views; True when `message` was one."""
        if message["type"] == "out":
            self._out(int(message["rank"]), message["text"])
        elif message["type"] == "metrics":
            self._metrics(message)
        else:
            return False
        return True

    def _out(self, rank: int, text: str) -> None:
        log = self._logs.get(rank)
        if log is None:
            log = self._logs[rank] = jobdir.open_private(jobdir.log_path(self.job.dir, rank), "a")
        log.write(text)
        log.flush()
        self.job._emit(rank, text)

    def _metrics(self, message: dict) -> None:
        name = str(message.get("file", ""))
        if not channel.METRICS_FILE.match(name):  # never a path: only the names the agent may send
            return
        with jobdir.open_private(self.job.dir / jobdir.METRICS / name, "a") as f:
            f.write(str(message.get("lines", "")))

    def _failure_message(self, rank: int, code: int) -> str:
        node, local_rank = divmod(rank, self.spec.procs_per_node)
        tail = "".join(self.job.logs(rank, tail=LAST_LINES)).rstrip()
        msg = f"rank {rank} (node {node} on host {self.hosts[node]}, local rank {local_rank}) {describe_exit(code)}"
        return msg + (f"; its last lines:\n{tail}" if tail else "")

    def _write_agent_logs(self) -> None:
        for conn in self.conns:
            if conn.stderr:
                with jobdir.open_private(self.job.dir / jobdir.LOGS / f"agent-node-{conn.node}.log", "a") as f:
                    f.write("\n".join(conn.stderr) + "\n")

    def kill_now(self) -> None:
        """At interpreter exit: close every connection at once; the agents stop their ranks."""
        self._stop.set()
        for conn in self.conns:
            conn.send({"type": "stop", "sigint_grace": 0.5, "sigterm_grace": 0.5})
        for conn in self.conns:
            conn.close(wait=2.0)
