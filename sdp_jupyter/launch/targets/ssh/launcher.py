"""The SSH target: `%%sdp_train --target ssh --hosts gpu1,gpu2` runs the cell on your own machines.

One OpenSSH client per host (`ssh -T`, BatchMode: the user's ~/.ssh/config, keys and jump hosts
apply, and nothing ever prompts) runs the per-host agent (launch/host/agent.py) and talks to it over the
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

import queue
import re
import shlex
import subprocess
import sys
from pathlib import Path

from sdp_jupyter.launch import process
from sdp_jupyter.launch.kernel.agent_run import run as agent_run
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.preparation import prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.kernel.agent_run.link import CONNECT_TIMEOUT, CONNECTED, ProcessLink
from sdp_jupyter.launch.spec import JobSpec, SpecError


from sdp_jupyter.launch.targets.ssh import KEYS, OPTIONS as SSH_OPTIONS  # noqa: E402  (the record's rows)
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


def ssh_command(host: str, spec: JobSpec, server: list[str] | None = None) -> list[str]:
    """The ssh client running the agent on `host`, or with `server` (its arguments) that host's warm
    pool server (launch/host/warm.py; its stderr goes nowhere: its ready line says what went wrong)."""
    options = spec.ssh or {}
    argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={CONNECT_TIMEOUT}",
            "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]
    if options.get("config"):
        argv += ["-F", str(Path(options["config"]).expanduser())]
    python = options.get("python") or sys.executable
    # the marker on stderr says "connected and authenticated" before the interpreter starts, so an
    # unreachable host is told apart from a slow interpreter
    if server is not None:
        # OpenBLAS would start its thread pool at import, and the pool must fork with one thread
        return argv + [host, f"echo {CONNECTED} >&2; OPENBLAS_NUM_THREADS=1 exec {shlex.quote(python)} -m "
                             f"sdp_jupyter.launch.host.warm {shlex.join(server)} 2>/dev/null"]
    return argv + [host, f"echo {CONNECTED} >&2; exec {shlex.quote(python)} -m sdp_jupyter.launch.host.agent"]


# The parent-death signal is set by a small interpreter that then becomes the client (exec keeps the
# signal), never by a preexec_fn: a preexec_fn makes Popen fork() this kernel instead of vfork(), and
# fork() runs OpenBLAS's pthread_atfork handler, which shuts OpenBLAS's thread pool down under a numpy
# call on the notebook's main thread: that call then spins forever (issue 40: notebook 09's `X @ w`
# cell hung while the finished job's warm pools started their ssh clients). Without a preexec_fn the
# kernel is never forked: no fork handler runs in it. argv: signal, the kernel's pid, the program, its args.
def _start_ssh(argv: list[str]) -> subprocess.Popen:
    """An ssh client (or srun) that dies with this process (process.start_kept)."""
    try:
        return process.start_kept(argv)
    except FileNotFoundError:
        raise SpecError("--target", "the OpenSSH client (`ssh`) is not installed here. "
                                    "Fix: apt-get install openssh-client") from None


class SSHLink(ProcessLink):
    """One host's ssh client running its agent."""

    kind = "ssh"

    def __init__(self, node: int, host: str, spec: JobSpec, inbox: queue.Queue):
        super().__init__(node, host, inbox)
        self.begin(_start_ssh(self.command_line(host, spec)))

    def command_line(self, host: str, spec: JobSpec) -> list[str]:
        """The client that runs the agent and carries its channel (the Slurm target's link: srun)."""
        return ssh_command(host, spec)

    def unreachable(self) -> str:
        return (f"not reachable within {CONNECT_TIMEOUT} s (ssh is still connecting: a host that is down, a name "
                f"that does not resolve, a firewall?). Fix: make `ssh -o BatchMode=yes {self.host} true` work "
                "from this machine")

    def diagnose(self, code: int | None, python: str) -> str:
        said = " ".join(line for line in self.stderr if line)[-400:]
        if "No module named" in said and "sdp_jupyter" in said:
            return super().diagnose(code, python) + ", or --python <its interpreter>"
        if code == 127 or "No such file" in said or "not found" in said:
            return f"{python} does not run there ({said or 'exit 127'}). Fix: --python <the interpreter on the host>"
        everything = " ".join(self.stderr)  # ssh's changed-key banner is longer than `said` keeps
        if "Host key verification failed" in everything:
            if "IDENTIFICATION HAS CHANGED" in everything:
                return (f"its host key is not the one known_hosts has for it, so ssh refused it (Host key "
                        f"verification failed): the host was reinstalled or re-keyed, or something is in the "
                        f"middle. Fix: once you know which, `ssh-keygen -R {self.host}`, then add its new key")
            return (f"its host key is not in known_hosts and ssh refuses unknown hosts (Host key verification "
                    f"failed). Fix: check the key's fingerprint, then `ssh-keyscan -H {self.host} >> "
                    f"~/.ssh/known_hosts` (or `ssh {self.host}` once and answer yes)")
        if code == 255:
            return (f"ssh cannot reach it ({said or 'exit 255'}). Fix: make `ssh -o BatchMode=yes {self.host} true` "
                    "work from this machine (host name, key, known_hosts, ~/.ssh/config)")
        return super().diagnose(code, python)


class SSHRun(agent_run.AgentRun):
    option = "--hosts"

    def __init__(self, spec: JobSpec, hosts: list[str], launcher: "SSHLauncher"):
        super().__init__(spec, hosts, launcher)
        if (spec.ssh or {}).get("hostfile"):
            self.option = "--hostfile"  # an unreachable host is reported under the option that named it
        self.python = (spec.ssh or {}).get("python") or sys.executable

    def open_links(self) -> list[agent_run.Link]:
        # every client starts at once (Popen returns before ssh connects); the hellos are awaited together
        return [SSHLink(node, host, self.spec, self.inbox) for node, host in enumerate(self.hosts)]

    def reopen(self, node: int, inbox: queue.Queue) -> agent_run.Link:
        return SSHLink(node, self.hosts[node], self.spec, inbox)

    def pool_key(self, node: int) -> tuple:
        options = self.spec.ssh or {}
        return ("ssh", self.hosts[node], self.python, options.get("config") or "")

    def warm_pool(self, node: int, preload: list[str] | tuple = ()):
        from sdp_jupyter.launch.kernel import warm_pool

        host, spec = self.hosts[node], self.spec
        return warm_pool.held_pool(self.pool_key(node), lambda args: _start_ssh(ssh_command(host, spec, args)), preload)


class SSHLauncher:
    """Runs a JobSpec on SSH hosts, one node per host. Grace periods (seconds) apply when stopping."""

    def __init__(self, sigint_grace: float = 3.0, sigterm_grace: float = 2.0):
        self.sigint_grace = sigint_grace
        self.sigterm_grace = sigterm_grace

    def resolve(self, spec: JobSpec) -> tuple[JobSpec, list[str], int | None]:
        hosts, slots = hosts_of(spec)
        spec = prepared(spec, nodes=len(hosts), procs_per_node=spec.procs_per_node or slots)  # --nodes: every host
        if spec.nodes > len(hosts):
            raise SpecError("--nodes", f"{spec.nodes} nodes but {len(hosts)} host(s) ({', '.join(hosts)}). "
                                       f"Fix: --nodes {len(hosts)}, or name more hosts")
        # an elastic job (--nodes MIN:MAX) keeps every host: those beyond MAX are spares
        return spec, hosts if spec.elastic else hosts[:spec.nodes], slots

    def start(self, spec: JobSpec, push: dict | None = None) -> Job:
        spec, hosts, _ = self.resolve(spec)
        return agent_run.start_job(SSHRun(spec, hosts, self), pickle_push(spec.push, push or {}))
