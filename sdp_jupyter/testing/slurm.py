"""A real Slurm cluster on a cluster-in-a-box (cluster.py), for the Slurm target's tests and notebook.

`slurmctld` runs on h0 (the login node, where the notebook runs) and `slurmd` on h1..h3 (the compute
nodes), all from Debian's `slurm-wlm`, authenticated by one `munged` (the hosts share the file system,
so one munge socket serves them all, as a shared key would on real machines). Everything lives under
`root`: the key, `slurm.conf` (clients find it through $SLURM_CONF: `env()`), spool and state folders,
logs. Two partitions: `debug` (default; the three nodes, 10 minutes at most) and `short` (h1 alone,
1 minute at most), so the launcher's refusals and a time limit can be tested. Every daemon runs in the
foreground and is stopped by PID in stop(). Needs root, slurm-wlm and munge.

    python -m sdp_jupyter.testing.slurm      # a cluster until Ctrl-C, with the SLURM_CONF to use
"""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

DAEMONS = ("/usr/sbin/munged", "/usr/sbin/slurmctld", "/usr/sbin/slurmd")
CTLD_PORT, SLURMD_PORT = 6817, 6818


def missing() -> str | None:
    """Why a Slurm test cluster cannot start here, else None."""
    lost = [d for d in DAEMONS if not os.path.exists(d)] + [c for c in ("sbatch", "srun", "squeue", "scancel", "sinfo")
                                                          if shutil.which(c) is None]
    if lost:
        return f"{', '.join(lost)} not installed (Debian: apt-get install slurm-wlm munge; ./dev.sh test does it)"
    return None


class SlurmHosts:
    def __init__(self, cluster, root: Path, cpus: int = 2):
        self.cluster, self.root = cluster, Path(root)
        self.nodes = [1, 2, 3]
        self.names = [cluster.hostnames[i] for i in self.nodes]
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.cpus = cpus
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, base: dict | None = None) -> dict:
        """An environment whose Slurm commands talk to this cluster."""
        env = dict(base if base is not None else os.environ)
        env["SLURM_CONF"] = str(self.conf)
        # the agents' job folders (node-N of each job, checkpoints included) live with this cluster and go
        # with it, never in the machine's ~/.cache, where a later run of a job's name would resume from them
        env["SDP_AGENT_DIR"] = str(self.agent_root)
        return env

    @property
    def agent_root(self) -> Path:
        return self.root / "agents"

    # ------------------------------------------------------------------ start and stop
    def start(self, timeout: float = 60.0) -> None:
        r = self.root
        r.mkdir(parents=True, exist_ok=True)
        os.chmod(r, 0o755)
        munge = r / "munge"
        munge.mkdir(mode=0o700, exist_ok=True)
        key = munge / "munge.key"
        key.write_bytes(secrets.token_bytes(1024))
        os.chmod(key, 0o400)
        self.procs["munged"] = subprocess.Popen(
            ["/usr/sbin/munged", "--foreground", "--force", f"--socket={self.socket}", f"--key-file={key}",
             f"--pid-file={munge / 'munged.pid'}", f"--seed-file={munge / 'munged.seed'}",
             f"--log-file={munge / 'munged.log'}"], stdout=subprocess.DEVNULL, stderr=open(r / "munged.out", "ab"))
        self._wait(lambda: self.socket.exists(), "munged did not make its socket", timeout)
        self._write_conf()
        for sub in ("state", "log") + tuple(f"spool-{n}" for n in self.names):
            (r / sub).mkdir(exist_ok=True)
        self.procs["slurmctld"] = self.cluster.popen(0, ["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)],
                                                     env=self.env(), stdout=subprocess.DEVNULL,
                                                     stderr=open(r / "log" / "slurmctld.out", "ab"))
        self.agent_root.mkdir(mode=0o700, exist_ok=True)
        for i, name in zip(self.nodes, self.names):
            self.procs[name] = self.cluster.popen(i, ["/usr/sbin/slurmd", "-D", "-N", name, "-f", str(self.conf)],
                                                  env=self.env(), stdout=subprocess.DEVNULL,
                                                  stderr=open(r / "log" / f"slurmd-{name}.out", "ab"))
        self._wait(lambda: self.idle_nodes() == sorted(self.names), "the nodes did not come up", timeout)

    def _write_conf(self) -> None:
        r = self.root
        a = self.cluster.addresses
        nodes = "\n".join(f"NodeName={n} NodeAddr={a[i]} CPUs={self.cpus} RealMemory=2000 State=UNKNOWN"
                          for i, n in zip(self.nodes, self.names))
        self.conf.write_text(f"""# the Slurm test cluster (sdp_jupyter.testing.slurm)
ClusterName=sdptest
SlurmctldHost={self.cluster.hostnames[0]}({a[0]})
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.socket}
CredType=cred/munge
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r}/spool-%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=300
{nodes}
PartitionName=debug Nodes={','.join(self.names)} Default=YES MaxTime=10 State=UP OverSubscribe=NO
PartitionName=short Nodes={self.names[0]} MaxTime=1 State=UP
""")

    def stop(self) -> None:
        """Cancel every job, then stop every daemon by PID (slurmd first, munged last)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            self.run(["scancel", "--full", "--user=root"], timeout=20)
        order = [n for n in self.names if n in self.procs] + ["slurmctld", "munged"]
        for name in order:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # ------------------------------------------------------------------ state
    def run(self, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command on h0, the login node (the test hosts' network is not this machine's)."""
        return self.cluster.run(0, argv, env=self.env(), timeout=timeout, check=False)

    def idle_nodes(self) -> list[str]:
        p = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        return sorted({line.split()[0] for line in p.stdout.splitlines() if line.split()[1:] == ["idle"]})

    def jobs(self) -> list[str]:
        """Ids of the jobs Slurm still has pending or running."""
        p = self.run(["squeue", "-h", "-o", "%i %T"])
        return [line.split()[0] for line in p.stdout.splitlines() if line.split()]

    def processes(self, host: int, module: str = "sdp_jupyter.launch.rank.worker") -> list[int]:
        """PIDs on `host` whose command line runs `module` (the ranks by default, or the agent)."""
        return self.cluster.running(host, module)

    def wait_clean(self, timeout: float) -> dict:
        """Wait until no rank or agent runs on any host and Slurm has no job left; what is left then."""
        deadline = time.monotonic() + timeout
        while True:
            left = {i: self.processes(i) + self.processes(i, "sdp_jupyter.launch.host.agent") for i in self.nodes}
            left = {f"h{i}": pids for i, pids in left.items() if pids}
            jobs = self.jobs()
            if jobs:
                left["slurm jobs"] = jobs
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def memory_mb(self) -> float:
        """Resident memory of the cluster's daemons (munged, slurmctld, every slurmd), in MB."""
        import psutil

        total = 0
        for proc in self.procs.values():
            try:
                p = psutil.Process(proc.pid)
                total += sum(q.memory_info().rss for q in [p] + p.children(recursive=True)
                             if q.name() in ("munged", "slurmctld", "slurmd"))
            except psutil.Error:
                pass
        return total / 1e6

    def _wait(self, ready, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited ({proc.returncode}); logs in {self.root}: {self._tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:g} s; logs in {self.root}: {self._tail()}")
            time.sleep(0.2)

    def _tail(self) -> str:
        texts = []
        for path in sorted(self.root.glob("log/*")) + sorted(self.root.glob("*.out")):
            try:
                texts.append(f"--- {path.name}: " + path.read_text()[-600:])
            except OSError:
                pass
        return "\n".join(texts)[-3000:]


def main() -> int:
    import tempfile

    from sdp_jupyter.testing.cluster import Cluster

    why = missing()
    if why:
        print(why)
        return 1
    with Cluster(4) as cluster:
        hosts = SlurmHosts(cluster, Path(tempfile.mkdtemp(prefix="sdp-slurm-")))
        try:
            hosts.start()
            print(f"Slurm cluster up: nodes {', '.join(hosts.names)}; SLURM_CONF={hosts.conf} "
                  f"(commands run on h0: {' '.join(cluster.enter(0))} ...). Ctrl-C stops it.", flush=True)
            signal.sigwait({signal.SIGINT, signal.SIGTERM})
        finally:
            hosts.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
