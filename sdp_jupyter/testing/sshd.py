"""An sshd on hosts h1..h3 of a cluster-in-a-box (cluster.py), for the SSH target's tests and benchmarks.

One key pair and one host key are made per SSHHosts; the client side (h0, where the "notebook" runs)
gets an ssh_config naming them and a known_hosts listing every host's key, so host keys are checked as
in real use (no StrictHostKeyChecking=no anywhere). Each sshd runs in the foreground (`-D`) in its
host's namespaces and is stopped by PID in stop(); it sets SDP_AGENT_DIR for its sessions so each
host's agent files are inspectable. Needs root and openssh-server.

`config` is for a client on h0. `outside_config()` is for a client on this machine outside the hosts'
network (a notebook's kernel started as usual): ssh reaches each host through a relay on h0
(`ProxyCommand`: `python -m sdp_jupyter.testing.sshd relay HOST PORT` entered into h0), the host keys
still checked. Only the ssh connections take that way; the ranks meet on the hosts' own network.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent  # the folder holding sdp_jupyter/
SSHD = "/usr/sbin/sshd"


class SSHHosts:
    def __init__(self, cluster, root: Path):
        self.cluster, self.root = cluster, root
        self.nodes = [1, 2, 3]
        self.hosts = [cluster.hostnames[i] for i in self.nodes]
        self.config = root / "ssh_config"
        self.procs: dict[int, subprocess.Popen] = {}

    def agent_dir(self, host: int) -> Path:
        return self.root / f"agent-h{host}"

    def start(self) -> None:
        r = self.root
        for key in ("hostkey", "id_ed25519"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(r / key)], check=True)
        shutil.copy(r / "id_ed25519.pub", r / "authorized_keys")
        hostkey = (r / "hostkey.pub").read_text().split()[:2]
        lines = [f"{self.cluster.hostnames[i]},{self.cluster.addresses[i]} {' '.join(hostkey)}" for i in self.nodes]
        (r / "known_hosts").write_text("\n".join(lines) + "\n")
        self.config.write_text(
            f"Host {' '.join(self.hosts)} 10.213.0.*\n"
            f"  User root\n  IdentityFile {r / 'id_ed25519'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {r / 'known_hosts'}\n  StrictHostKeyChecking yes\n"
            f"  GlobalKnownHostsFile /dev/null\n  LogLevel ERROR\n")
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation directory
        for i in self.nodes:
            self.agent_dir(i).mkdir(mode=0o700)
            self.procs[i] = self.cluster.popen(i, [
                SSHD, "-D", "-e", "-f", "/dev/null", "-p", "22", "-h", str(r / "hostkey"),
                "-o", f"ListenAddress={self.cluster.addresses[i]}",
                "-o", f"AuthorizedKeysFile={r / 'authorized_keys'}", "-o", "UsePAM=no", "-o", "StrictModes=no",
                "-o", f"PidFile={r / f'sshd-h{i}.pid'}", "-o", "PermitRootLogin=prohibit-password",
                "-o", f"SetEnv=SDP_AGENT_DIR={self.agent_dir(i)}", "-o", "MaxStartups=50",
                "-o", "Subsystem=sftp internal-sftp"],
                stdout=subprocess.DEVNULL, stderr=open(r / f"sshd-h{i}.log", "ab"))
        for i in self.nodes:
            self._wait_listening(i)

    def outside_config(self) -> Path:
        """An ssh_config for a client outside the hosts' network: `config` plus a ProxyCommand that
        relays each connection from h0 (written next to `config`)."""
        relay = shlex.join(self.cluster.enter(0) + [sys.executable, "-m", "sdp_jupyter.testing.sshd", "relay"])
        path = self.root / "ssh_config_outside"
        path.write_text(self.config.read_text() + f"  ProxyCommand {relay} %h %p\n")
        return path

    def _wait_listening(self, host: int, timeout: float = 15.0) -> None:
        probe = f"import socket; socket.create_connection(('{self.cluster.addresses[host]}', 22), 1).close()"
        deadline = time.monotonic() + timeout
        while True:
            if self.procs[host].poll() is not None:
                raise RuntimeError(f"sshd on h{host} exited: {(self.root / f'sshd-h{host}.log').read_text()[-2000:]}")
            p = self.cluster.run(0, [sys.executable, "-c", probe], check=False, timeout=10)
            if p.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd on h{host} does not listen: {p.stderr[-500:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def driver(self, code: str, env: dict | None = None) -> subprocess.Popen:
        """Run Python `code` on h0 (the notebook's machine), output captured as text."""
        full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
                    **(env or {}))
        return self.cluster.popen(0, [sys.executable, "-c", code], env=full, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)

    def processes(self, host: int, module: str = "sdp_jupyter.launch.rank.worker") -> list[int]:
        """PIDs on `host` whose command line runs `module` (the ranks by default, or the agent)."""
        return self.cluster.running(host, module)

    def wait_clean(self, timeout: float) -> dict[int, list[int]]:
        """Wait until no rank or agent runs on any host; what is left at the deadline."""
        deadline = time.monotonic() + timeout
        while True:
            left = {i: self.processes(i) + self.processes(i, "sdp_jupyter.launch.host.agent") for i in self.nodes}
            left = {i: pids for i, pids in left.items() if pids}
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


def relay(host: str, port: int) -> None:
    """Copy stdin to a TCP connection to host:port and the connection to stdout until both ends close
    (ssh's ProxyCommand)."""
    sock = socket.create_connection((host, port), timeout=10)
    sock.settimeout(None)

    def upstream() -> None:
        while data := os.read(0, 65536):
            sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)

    threading.Thread(target=upstream, daemon=True).start()
    while data := sock.recv(65536):
        os.write(1, data)


if __name__ == "__main__":
    if sys.argv[1:2] != ["relay"] or len(sys.argv) != 4:
        sys.exit("usage: python -m sdp_jupyter.testing.sshd relay HOST PORT")
    relay(sys.argv[2], int(sys.argv[3]))
