"""A real Ray cluster on the shared cluster-in-a-box: the head on h0, a worker on each of h1..h3.

Each node is `ray start ... --block` inside its test host (own address, hostname and /dev/shm; its own
--temp-dir, since the hosts share a filesystem), with token authentication and a small object store.
The test's driver runs on h0 too, with the same token. Everything is stopped by PID when the test module ends
(never `ray stop`, which would end every Ray process on the machine).
"""
from __future__ import annotations

import os
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from sdp_jupyter.testing.cluster import signal_all


RAY = str(Path(sys.executable).with_name("ray"))

# The watcher: connects once, then answers each line on stdin with the alive nodes (address,id ...).
_WATCHER = """
import sys, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
for _ in sys.stdin:
    print("ALIVE", *(f"{n['NodeManagerAddress']},{n['NodeID']}" for n in ray.nodes() if n["Alive"]), flush=True)
"""


class RayHosts:
    def __init__(self, cluster, root: Path):
        self.cluster, self.root = cluster, root
        self.address = f"{cluster.addresses[0]}:6379"
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
                        RAY_USAGE_STATS_ENABLED="0", RAY_DISABLE_IMPORT_WARNING="1")
        self.env.pop("RAY_ADDRESS", None)
        self.starts: dict[int, subprocess.Popen] = {}
        self.watcher: subprocess.Popen | None = None  # one driver that answers "which nodes are alive"
        self.node_env: dict[int, dict | None] = {}
        self.retries: dict[int, int] = {}
        self.last_error = ""

    def start(self) -> None:
        # One node at a time: a starting node's raylet waits at most 15 s (Ray's own limit) for its
        # dashboard agent, a Python process that imports much of Ray. Three worker nodes starting at
        # once on a 2-core machine (about a dozen such processes) took 20 s, and every raylet crashed.
        for i in range(self.cluster.n):
            self._start_node(i)
            self._wait_nodes(i + 1)

    def _start_node(self, i: int, env: dict | None = None) -> None:
        head = ["--head", "--port", "6379", "--include-dashboard=false"] if i == 0 else ["--address", self.address]
        argv = [RAY, "start", *head, "--node-ip-address", self.cluster.addresses[i], "--num-cpus", "1",
                "--object-store-memory", str(80 << 20), "--temp-dir", str(self.root / f"h{i}"),
                "--disable-usage-stats", "--block"]
        self.node_env[i] = env
        # the agents' job folders (checkpoints included) stay with these hosts: in the machine's ~/.cache a
        # later run of a test's job name would resume from them (Ray's workers inherit the node's environment)
        agents = {"SDP_AGENT_DIR": str(self.root / f"agents-h{i}")}
        with open(self.root / f"ray-h{i}.log", "ab") as log:
            self.starts[i] = self.cluster.popen(i, argv, env={**self.env, **agents, **(env or {})}, stdout=log,
                                                stderr=subprocess.STDOUT)

    def restart_node(self, i: int, env: dict | None = None) -> None:
        """Start worker host `i`'s Ray node again (what is left of it is killed first), with `env` added
        to its environment (and its workers'). Returns when a new node is alive at that host's address
        and the old one is gone from the cluster's view (a killed raylet stays 'Alive' to the head until
        its health checks fail, so counting alive nodes alone can return before the new node exists)."""
        old = {node for ip, node in self._alive() if ip == self.cluster.addresses[i]}
        signal_all(self.ray_pids(i), signal.SIGKILL)
        if i in self.starts:
            self.starts[i].wait()
        self.retries[i] = 0
        self._start_node(i, env)
        self._wait_nodes(self.cluster.n, gone=old)

    def _alive(self) -> list[tuple[str, str]] | None:
        """(address, node id) of each node the head calls alive; None when the head cannot be asked.
        Asked of one long-lived driver on h0: a driver per question (import ray, connect) cost seconds of
        CPU each, taken from the nodes starting beside it."""
        if self.watcher is None or self.watcher.poll() is not None:
            if self.watcher is not None:
                self.last_error = (self.root / "watcher.log").read_text()[-2000:]
            with open(self.root / "watcher.log", "ab") as log:
                # unbuffered: select() then sees every line (none waits in a reader's buffer)
                self.watcher = self.cluster.popen(0, [sys.executable, "-u", "-c", _WATCHER, self.address], env=self.env,
                                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0)
        try:
            self.watcher.stdin.write(b"nodes\n")
            self.watcher.stdin.flush()
        except OSError:
            return None
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            if not select.select([self.watcher.stdout], [], [], 1.0)[0]:
                continue
            line = self.watcher.stdout.readline().decode(errors="replace")
            if not line:  # it ended: ray.init could not reach the head (yet)
                return None
            if line.startswith("ALIVE"):  # only the answer: a driver also prints what a crashing raylet logged
                return [tuple(pair.split(",")) for pair in line.split()[1:]]
        self.watcher.kill()  # stuck: the next poll starts a new one (poll() sees this one ended)
        self.watcher.wait()
        return None

    def _wait_nodes(self, n: int, gone: set = frozenset(), timeout: float = 120.0) -> None:
        """Until the first `n` hosts each have an alive node, none of whose ids is in `gone`."""
        want = set(self.cluster.addresses[:n])
        deadline = time.monotonic() + timeout
        while True:
            for i, p in list(self.starts.items()):
                if p.poll() is not None:
                    # Ray gives a raylet 30 s to register (hard-coded); on a loaded 2-core machine it can
                    # miss that: start the node again, twice at most
                    self._retry(i, "exited")
            alive = self._alive()
            if alive is not None and {ip for ip, _ in alive} >= want and not {node for _, node in alive} & gone:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Ray cluster did not reach {n} nodes (alive: {alive}, waiting for "
                                   f"{sorted(gone)} to be gone): {self.last_error}\nh0's log: "
                                   f"{self._log_tail(0)}")
            time.sleep(1)

    def _retry(self, i: int, why: str) -> None:
        self.retries[i] = self.retries.get(i, 0) + 1
        if self.retries[i] > 2:
            raise RuntimeError(f"ray start on h{i} {why}, three times: {self._log_tail(i)}")
        self._start_node(i, self.node_env.get(i))

    def _log_tail(self, i: int) -> str:
        try:
            return (self.root / f"ray-h{i}.log").read_text(errors="replace")[-3000:]
        except OSError as e:
            return str(e)

    def ray_pids(self, host: int) -> list[int]:
        found = []
        for pid in self.cluster.pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"ray" in argv and b"sshd" not in argv:
                found.append(pid)
        return found

    def memory_mb(self) -> float:
        """Resident memory of every Ray process of the test cluster, in MB."""
        total = 0
        for host in range(self.cluster.n):
            for pid in self.ray_pids(host):
                try:
                    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                        if line.startswith("VmRSS:"):
                            total += int(line.split()[1])
                except OSError:
                    pass
        return total / 1024

    def stop(self) -> None:
        if self.watcher is not None and self.watcher.poll() is None:
            self.watcher.kill()
            self.watcher.wait()
        for p in self.starts.values():  # `ray start --block` stops its node's processes on SIGTERM
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.starts.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        time.sleep(0.5)
        for host in range(self.cluster.n):  # and by PID what outlived it
            signal_all(self.ray_pids(host), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_hosts(cluster4):
    """A Ray head on h0 and workers on h1..h3 of the shared cluster, for one test module (its 2 GB and
    its background CPU are given back when the module ends). Skipped without ray."""
    if not os.path.exists(RAY):
        pytest.skip("ray is not installed (pip install ray: the `ray` extra)")
    # a short folder of its own: Ray's sockets live under --temp-dir, and a Unix socket's path has at most
    # 107 bytes; under pytest-xdist's basetemp (.../popen-gw0/ray0/h0/session_<date>_<pid>/sockets/
    # plasma_store) it took 109, and the head never came up (every parallel run, until this)
    hosts = RayHosts(cluster4, Path(tempfile.mkdtemp(prefix="sdp-ray-")))
    try:
        hosts.start()
        yield hosts
    finally:
        hosts.stop()
