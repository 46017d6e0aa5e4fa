"""Cluster in a box: several real hosts on one machine, joined by links of a chosen rate.

    from sdp_jupyter.testing.cluster import Cluster
    with Cluster(hosts=3, rate="2gbit") as c:
        c.run(0, ["hostname"])                      # -> "h0"
        p = c.popen(1, [sys.executable, "train.py"], env={...})
        c.cut(2); c.heal(2); c.shape(1, "10mbit"); c.bytes(0)
        km = c.kernel_manager(0, folder)            # a Jupyter kernel on h0 (nbclient's km=)

Each host is a network namespace with its own veth (`eth0`, address 10.213.0.<i+1>/24) into a
bridge that lives in a namespace of its own (the root namespace is left alone), its own hostname
(`h<i>`, a UTS namespace), its own tmpfs `/dev/shm` and its own `/etc/hosts` naming every host (a
mount namespace), so two hosts never meet in shared memory. Both directions of every link are
shaped with `tc tbf` (this kernel has no `netem`, so there is no added delay; `netem_available()`
says whether it exists).

Processes enter a host with `nsenter --net --mount --uts` (not `ip netns exec`, which makes a fresh
mount namespace per call, so ranks of one host could not share `/dev/shm`). Teardown kills every
process in the namespaces by PID and removes every namespace, mount and folder; it runs on exit
of the `with` block, at interpreter exit, on SIGTERM, and `python -m sdp_jupyter.testing.cluster
clean` removes what a killed run left. Needs root and iproute2 (`Cluster.available()` says why not).
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

PREFIX = "sdptb"                 # every namespace this module makes starts with it
STATE_ROOT = Path("/run/sdp-testbed")
SUBNET = "10.213.0"              # a private test range; traffic goes only to these test hosts
_LIVE: set["Cluster"] = set()
# The SIGTERM handler the first live cluster replaced (restored when the last one closes).
_TERM_BEFORE: list = []


def _sh(*argv: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, text=True, input=input)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def available() -> str | None:
    """None when clusters can be made here, else the reason (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "nsenter", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing (apt-get install iproute2 util-linux)"
    probe = f"{PREFIX}probe{secrets.token_hex(2)}"
    p = _sh("ip", "netns", "add", probe, check=False)
    if p.returncode != 0:
        return f"cannot make a network namespace: {p.stderr.strip()}"
    _sh("ip", "netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether this kernel has the netem qdisc (delay, loss); tbf works without it."""
    probe = f"{PREFIX}nq{secrets.token_hex(2)}"
    if _sh("ip", "netns", "add", probe, check=False).returncode != 0:
        return False
    try:
        return _sh("tc", "-n", probe, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms",
                   check=False).returncode == 0
    finally:
        _sh("ip", "netns", "del", probe, check=False)


class Cluster:
    """N hosts in network namespaces behind a bridge; see the module docstring."""

    def __init__(self, hosts: int = 2, rate: str | None = "2gbit", burst: str = "256kb", latency: str = "5ms",
                 run_id: str | None = None):
        if not 1 <= hosts <= 200:
            raise ValueError("hosts must be between 1 and 200")
        self.n = hosts
        self.rate, self.burst, self.latency = rate, burst, latency
        self.run_id = run_id or secrets.token_hex(3)
        self.name = f"{PREFIX}{self.run_id}"
        self.dir = STATE_ROOT / self.name
        self.bridge_ns = f"{self.name}-br"
        self.host_ns = [f"{self.name}-h{i}" for i in range(hosts)]
        self.hostnames = [f"h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self._procs: list[subprocess.Popen] = []
        self._up = False

    @classmethod
    def existing(cls, name: str, hosts: int) -> "Cluster":
        """The running cluster another process started (its `name`): its links can be cut and healed
        and its processes seen from here; start() and close() stay with its owner."""
        if not name.startswith(PREFIX) or not (STATE_ROOT / name).is_dir():
            raise ValueError(f"no test cluster named {name!r} runs here")
        return cls(hosts, rate=None, run_id=name[len(PREFIX):])

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> "Cluster":
        why = available()
        if why:
            raise RuntimeError(f"cannot make a test cluster: {why}")
        clean()  # what a killed run left (its owner is gone): it would otherwise stay until someone runs `clean`
        _LIVE.add(self)
        self._up = True
        if _is_main_thread() and signal.getsignal(signal.SIGTERM) is not _on_sigterm:
            _TERM_BEFORE[:] = [signal.signal(signal.SIGTERM, _on_sigterm)]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            (self.dir / "owner").write_text(str(os.getpid()))
            hosts = "127.0.0.1 localhost\n" + "".join(f"{a} {h}\n" for a, h in zip(self.addresses, self.hostnames))
            (self.dir / "hosts").write_text(hosts)
            _sh("ip", "netns", "add", self.bridge_ns)
            _sh("ip", "-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.bridge_ns, "link", "set", "br0", "up")
            for i in range(self.n):
                self._make_host(i)
        except BaseException:
            self.close()
            raise
        return self

    def _make_host(self, i: int) -> None:
        ns, d = self.host_ns[i], self.dir / f"h{i}"
        _sh("ip", "netns", "add", ns)
        _sh("ip", "-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"b{i}", "netns", self.bridge_ns)
        _sh("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "-n", ns, "link", "set", "eth0", "up")
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"b{i}", "master", "br0")
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"b{i}", "up")
        if self.rate:
            self.shape(i, self.rate)
        # Persistent mount and UTS namespaces, entered later with nsenter: `ip netns exec` would make a fresh
        # mount namespace per call, so a host's processes would not share its /dev/shm.
        d.mkdir(parents=True, exist_ok=True)
        _sh("mount", "--bind", str(d), str(d))
        _sh("mount", "--make-private", str(d))
        (d / "mnt").touch()
        (d / "uts").touch()
        setup = (f"hostname {self.hostnames[i]} && mount -t tmpfs -o mode=1777 tmpfs /dev/shm && "
                 f"mount --bind {self.dir / 'hosts'} /etc/hosts")
        _sh("nsenter", f"--net=/var/run/netns/{ns}", "unshare", f"--mount={d / 'mnt'}", f"--uts={d / 'uts'}",
            "--propagation", "private", "sh", "-c", setup)

    def close(self) -> None:
        """Shut every host down (SIGTERM, then SIGKILL after 2 s), remove namespaces, mounts and folders. Idempotent."""
        if not self._up:
            return
        self._up = False
        # _teardown signals every process in the hosts' namespaces, those started by popen() included
        # (nsenter execs the command, in the namespace): one SIGTERM each, as a machine shutting down
        # sends. A second SIGTERM could land after Python's exit has put the default handler back,
        # and kill a process that was ending cleanly on the first.
        _teardown(self.name)
        for p in self._procs:  # one not yet in its namespace when the hosts were emptied is killed here
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        _LIVE.discard(self)
        if not _LIVE and _TERM_BEFORE and _is_main_thread():
            before = _TERM_BEFORE.pop()
            if before is not None:  # None: a handler not set from Python, which Python cannot put back
                signal.signal(signal.SIGTERM, before)

    # ------------------------------------------------------------------ processes
    def enter(self, host: int, cwd: str | os.PathLike | None = None) -> list[str]:
        """The argv prefix that runs a command on `host`, in `cwd` (entering the host's mount namespace
        otherwise leaves the command in /)."""
        d = self.dir / f"h{host}"
        wd = [f"--wd={cwd}"] if cwd is not None else []
        return ["nsenter", f"--net=/var/run/netns/{self.host_ns[host]}", f"--mount={d / 'mnt'}",
                f"--uts={d / 'uts'}", *wd, "--"]

    def kernel_manager(self, host: int, folder: str | os.PathLike, cwd: str | os.PathLike | None = None):
        """A jupyter_client AsyncKernelManager whose kernel (ipykernel on this interpreter) runs on `host`,
        in `cwd`: its kernelspec, written under `folder`, starts it through enter(host), and its channels
        are ZeroMQ over unix sockets (transport "ipc") under `folder`, which both sides reach through
        the file system the hosts share (a host's network is not this machine's). Hand it to nbclient
        (NotebookClient(km=...)) or start it yourself (start_kernel(env=...))."""
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import AsyncKernelManager

        ipc = Path(folder).resolve() / "kernel-ipc"  # absolute: the kernel's cwd is not ours
        if len(str(ipc)) > 100:  # a unix socket's path has room for 107 bytes; "-N" is added
            raise ValueError(f"{folder} is too long a path for the kernel's unix sockets: take a shorter one")
        name = f"sdp-testbed-{self.hostnames[host]}"
        kernels = Path(folder) / "kernels"
        (kernels / name).mkdir(parents=True, exist_ok=True)
        argv = self.enter(host, cwd) + [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]
        (kernels / name / "kernel.json").write_text(json.dumps(
            {"argv": argv, "display_name": f"Python 3 on test host {self.hostnames[host]}", "language": "python"}))
        return AsyncKernelManager(kernel_name=name, transport="ipc", ip=str(ipc),
                                  kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(kernels)]))

    def popen(self, host: int, argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """Start `argv` on `host` (environment `env`, or this process's); killed at teardown."""
        p = subprocess.Popen(self.enter(host) + list(argv), env=env, **kw)
        self._procs.append(p)
        return p

    def run(self, host: int, argv: list[str], env: dict | None = None, timeout: float = 60,
            check: bool = True) -> subprocess.CompletedProcess:
        p = subprocess.run(self.enter(host) + list(argv), env=env, capture_output=True, text=True,
                           timeout=timeout)
        if check and p.returncode != 0:
            raise RuntimeError(f"{argv} on {self.hostnames[host]} failed ({p.returncode}): {p.stderr[-2000:]}")
        return p

    def pids(self, host: int) -> list[int]:
        return _pids([self.host_ns[host]])

    def running(self, host: int, module: str) -> list[int]:
        """PIDs on `host` whose command line runs `module` (python -m MODULE, or MODULE as a word)."""
        found = []
        for pid in self.pids(host):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if module.encode() in argv:
                found.append(pid)
        return found

    def kill_host(self, host: int, sig: int = signal.SIGKILL) -> list[int]:
        """Send `sig` to every process running on `host` (a host losing power, as far as its
        processes are concerned). Returns the PIDs signalled."""
        pids = self.pids(host)
        signal_all(pids, sig)
        return pids

    # ------------------------------------------------------------------ links
    def cut(self, host: int) -> None:
        """Take `host`'s link down at the bridge: nothing goes in or out, the host does not know."""
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"b{host}", "down")

    def heal(self, host: int) -> None:
        _sh("ip", "-n", self.bridge_ns, "link", "set", f"b{host}", "up")

    def shape(self, host: int, rate: str) -> None:
        """Limit both directions of `host`'s link to `rate` (tc's syntax: 10mbit, 2gbit)."""
        for ns, dev in ((self.host_ns[host], "eth0"), (self.bridge_ns, f"b{host}")):
            _sh("tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                "burst", self.burst, "latency", self.latency)

    def bytes(self, host: int) -> dict:
        """Byte counters of `host`'s link: {"tx": sent by the host, "rx": received by it}."""
        out = _sh("ip", "-n", self.host_ns[host], "-s", "-j", "link", "show", "eth0").stdout
        stats = json.loads(out)[0]["stats64"]
        return {"tx": int(stats["tx"]["bytes"]), "rx": int(stats["rx"]["bytes"])}


def _is_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _on_sigterm(signum, frame):
    # Tear every live cluster down, then do what the process would have done without us: call the
    # handler that was there before (the suite's turns SIGTERM into an interrupt, so pytest stops
    # and tears its other fixtures down too: tests/helpers/terminate.py), or die of SIGTERM. Raising
    # SystemExit here instead would be caught by a test runner, which then goes on with the hosts gone.
    before = _TERM_BEFORE[0] if _TERM_BEFORE else signal.SIG_DFL
    _close_all()
    if callable(before):
        signal.signal(signal.SIGTERM, before)
        before(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def _pids(namespaces: list[str]) -> list[int]:
    return [int(pid) for ns in namespaces for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]


def signal_all(pids: list[int], sig: int) -> None:
    """Send `sig` to each of `pids`; one that has ended since it was listed is skipped."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _teardown(name: str, grace: float = 2.0) -> None:
    """Remove everything of the run `name` (a cluster's name, PREFIX + run id)."""
    netns = [n.split()[0] for n in _sh("ip", "netns", "list", check=False).stdout.splitlines() if n.strip()]
    mine = [n for n in netns if n.startswith(name + "-")]
    # as a machine shuts down: SIGTERM first, so that what a process removes on its way out (a warm
    # pool's socket folder, in the /tmp the hosts share with this machine) goes; SIGKILL after `grace`
    signal_all(_pids(mine), signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _pids(mine) and time.monotonic() < deadline:
        time.sleep(0.05)
    for _ in range(3):  # processes may fork while we kill: repeat until the namespaces are empty
        pids = _pids(mine)
        if not pids:
            break
        signal_all(pids, signal.SIGKILL)
        time.sleep(0.2)
    for ns in mine:
        _sh("ip", "netns", "del", ns, check=False)
    d = STATE_ROOT / name
    if d.is_dir():
        for host_dir in sorted(d.glob("h*")):
            for f in ("mnt", "uts"):
                _sh("umount", "-l", str(host_dir / f), check=False)
            _sh("umount", "-l", str(host_dir), check=False)
        shutil.rmtree(d, ignore_errors=True)


def clean() -> list[str]:
    """Remove what killed runs left behind (their owner process is gone). Returns the run names."""
    runs = set()
    for line in _sh("ip", "netns", "list", check=False).stdout.splitlines():
        n = line.split()[0] if line.strip() else ""
        if n.startswith(PREFIX) and "-" in n:
            runs.add(n.split("-")[0])
    if STATE_ROOT.is_dir():
        runs.update(d.name for d in STATE_ROOT.iterdir() if d.name.startswith(PREFIX))
    removed = []
    for name in sorted(runs - {c.name for c in _LIVE}):  # this process's own live clusters stay
        owner = STATE_ROOT / name / "owner"
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
            if pid != os.getpid():
                continue  # its owner is alive: not a leftover
        except (OSError, ValueError):
            if _starting(STATE_ROOT / name):
                continue  # another process is making it (a parallel test run): its owner file comes next
        _teardown(name)
        removed.append(name)
    return removed


def _starting(run_dir: Path, within: float = 60.0) -> bool:
    """Whether `run_dir` was made in the last `within` seconds and has no owner file yet: start() makes
    the folder, then writes the owner, then the namespaces; a run killed in between is cleaned later."""
    try:
        return not (run_dir / "owner").exists() and time.time() - run_dir.stat().st_mtime < within
    except OSError:
        return False


@atexit.register
def _close_all() -> None:
    for c in list(_LIVE):
        c.close()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["clean"]:
        removed = clean()
        print(f"removed {len(removed)} leftover test cluster(s)" + (f": {', '.join(removed)}" if removed else ""))
        return 0
    print("usage: python -m sdp_jupyter.testing.cluster clean", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
