"""Every entry of docs/troubleshooting.md, reproduced: each test makes the condition happen for real (a
script without the plugin, a firewall's port range, a /dev/shm too small, a process whose memory may
not be read, an SSH host key that is unknown or changed, a peer of another version, a job whose ranks
never talk, a warm pool that must not fork, a stalled rank) and asserts that what the user sees
contains every fragment the page quotes for it."""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading

import pytest

from helpers.remote_jobs import LAUNCH, next_line
from helpers.troubleshooting_page import quoted
from sdp_jupyter.launch import launch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(extra)
    return env


def _ranks(script: str, world: int, timeout: float = 60, wrap=(), **env) -> list[str]:
    """`world` plain ranks of `script` on this machine, started the way torchrun would (RANK,
    WORLD_SIZE, MASTER_ADDR, MASTER_PORT, ...); each one's output, stderr merged."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(list(wrap) + [sys.executable, "-c", textwrap.dedent(script)],
                              env=_env(**{"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                          "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                          "MASTER_PORT": str(port), **env}),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            p.kill()
            outs.append(p.communicate()[0])
    return outs


def _has_all(text: str, heading: str, block: int | None = None) -> None:
    for fragment in quoted(heading, block):
        assert fragment in text, f"the page's quote {fragment!r} is not in what the user sees:\n{text[-3000:]}"


def _write(path, text: str) -> str:
    path.write_text(textwrap.dedent(text))
    return str(path)


# ------------------------------------------------------------------------------- Unknown backend type
NO_IMPORT = """
import os, torch, torch.distributed as dist
dist.init_process_group("smddp", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"])
print("backend", dist.get_backend())
"""


def test_unknown_backend_without_the_plugin_and_the_import_that_fixes_it():
    (out,) = _ranks(NO_IMPORT, 1, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    _has_all(out, "Unknown backend type smddp")
    (out,) = _ranks("import sdp_jupyter.torch\n" + NO_IMPORT, 1, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert "backend smddp" in out, out


# ------------------------------------------------------------------------------ firewall: port range
LISTENERS = """
import json, os, psutil, sdp_jupyter, torch, torch.distributed as dist
dist.init_process_group("smddp")
ports = sorted({c.laddr.port for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN})
dist.all_reduce(torch.ones(4))
sdp_jupyter.report(step=0, listening=json.dumps(ports), master_port=int(os.environ["MASTER_PORT"]))
"""


def test_every_port_of_a_job_is_inside_sdp_port_range(tmp_path, jobs_dir):
    """2 nodes x 2 ranks, `--env SDP_PORT_RANGE=...`: the store's MASTER_PORT and each rank's message
    listener (what listens after set-up) take their port from the range; a node's engine listener,
    open during set-up only, takes its port there too (checked by the next test's full range)."""
    lo, hi = 31400, 31449
    job = launch(_write(tmp_path / "ports.py", LISTENERS), nodes=2, procs_per_node=2, name="ports",
                 env={"SDP_PORT_RANGE": f"{lo}-{hi}"})
    assert job.wait(120) == "succeeded", job.summary() + job.logs(0)
    rows = [json.loads(line) for f in sorted((job.dir / "metrics").glob("rank-*.jsonl"))
            for line in f.read_text().splitlines() if '"listening"' in line]
    assert len(rows) == 4
    ports = {p for row in rows for p in json.loads(row["listening"])} | {rows[0]["master_port"]}
    assert len(ports) >= 5 and all(lo <= p <= hi for p in ports), ports


def test_a_full_port_range_and_a_bad_one_say_so():
    from sdp_jupyter import _engine
    from sdp_jupyter._net import port_range

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        mailbox = _engine.Mailbox(0, 1, b"s" * 32, "127.0.0.1", 5.0, False)
        with pytest.raises(Exception) as err:
            mailbox.listen(port, port)
        mailbox.shutdown()
    assert f"no port of SDP_PORT_RANGE={port}-{port} is free" in str(err.value) and "widen the range" in str(err.value)
    # a node leader's engine listener (two ranks on the node): inside the range, or the same error
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    leader = _engine.Engine(0, [0, 0], b"s" * 32, "127.0.0.1", 5.0, 4096, -1)
    assert leader.prepare(free, free)[0] == free
    leader.shutdown()
    leader = _engine.Engine(0, [0, 0], b"s" * 32, "127.0.0.1", 5.0, 4096, -1)
    with socket.socket() as taken, pytest.raises(Exception, match=f"no port of SDP_PORT_RANGE={free}-{free}"):
        taken.bind(("127.0.0.1", free))
        taken.listen(1)
        leader.prepare(free, free)
    leader.shutdown()
    _has_all(str(err.value).replace(f"{port}-{port}", "31400-31449"), "A rendezvous that never completes behind a firewall")
    with pytest.raises(ValueError, match="SDP_PORT_RANGE='31400' is not a port range: use LO-HI"):
        port_range({"SDP_PORT_RANGE": "31400"})
    assert port_range({"SDP_PORT_RANGE": " 31400-31449 "}) == (31400, 31449) and port_range({}) is None


# ------------------------------------------------------------------------------------ /dev/shm small
def test_a_small_dev_shm_is_named_not_a_sigbus():
    """/dev/shm of 1 MiB (a private mount namespace, as in a container run without --shm-size)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare to mount a small /dev/shm in a private mount namespace")
    script = """
    import torch, torch.distributed as dist
    dist.init_process_group("smddp")
    dist.all_reduce(torch.ones(4))
    """
    wrap = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"', "sh"]
    probe = subprocess.run(wrap + ["true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {probe.stderr.strip()}")
    # both ranks in one namespace: one unshare runs the pair
    runner = f"""
import subprocess, sys
procs = [subprocess.Popen([sys.executable, "-c", {textwrap.dedent(script)!r}], env=dict(__import__("os").environ,
         RANK=str(r), LOCAL_RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
print("\\n".join(p.communicate(timeout=60)[0] for p in procs))
"""
    (out,) = _ranks(runner, 1, wrap=wrap, WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    _has_all(out, "/dev/shm is too small (containers)")
    assert "SIGBUS" not in out


# ------------------------------------------------------------------------------ peer memory refused
PEER_READS = """
import ctypes
from sdp_jupyter.doctor.checks import check_peer_reads
from sdp_jupyter.doctor.report import Report
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)   # PR_SET_DUMPABLE 0: no process without CAP_SYS_PTRACE may read us
r = Report()
check_peer_reads(r)
print(r.text())
"""


def test_refused_peer_memory_reads_are_a_warning_with_the_fix():
    """A process that is not dumpable, its probe child without CAP_SYS_PTRACE: the read is refused (EPERM)."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_SYS_PTRACE")
    wrap = ["setpriv", "--bounding-set=-sys_ptrace", "--inh-caps=-sys_ptrace"]
    p = subprocess.run(wrap + [sys.executable, "-c", PEER_READS], capture_output=True, text=True, env=_env(),
                       cwd="/", timeout=60)
    assert p.returncode == 0, p.stderr
    _has_all(p.stdout, "Peer memory reads are refused")


# ---------------------------------------------------------------------------------------- SSH keys
def _ssh_error(ssh_hosts, known_hosts: str, tmp_path) -> str:
    kh = tmp_path / "known_hosts"
    kh.write_text(known_hosts)
    config = tmp_path / "ssh_config"
    config.write_text(ssh_hosts.config.read_text().replace(str(ssh_hosts.root / "known_hosts"), str(kh)))
    args = {"target": "ssh", "ssh": {"hosts": ["h1"], "config": str(config)}, "jobs_dir": str(tmp_path / "jobs"),
            "code": "print(1)"}
    d = ssh_hosts.cluster.popen(0, [sys.executable, "-c", LAUNCH, json.dumps(args)], env=_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return next_line(d)["spec_error"]


@pytest.mark.slow
def test_an_unknown_or_changed_ssh_host_key_is_refused_with_the_fix(ssh_hosts, tmp_path):
    err = _ssh_error(ssh_hosts, "", tmp_path)
    assert "h1: its host key is not in known_hosts" in err, err
    unknown = err
    other = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    assert other.returncode == 0
    key = " ".join((tmp_path / "other.pub").read_text().split()[:2])
    err = _ssh_error(ssh_hosts, f"h1,{ssh_hosts.cluster.addresses[1]} {key}\n", tmp_path)
    assert "h1: its host key is not the one known_hosts has for it" in err, err
    _has_all(unknown + "\n" + err, "SSH refuses a host key")


# ------------------------------------------------------------------------------ versions that differ
@pytest.mark.slow
def test_a_host_with_another_sdp_jupyter_is_refused_before_anything_starts(ssh_hosts, tmp_path):
    """The notebook side says it is 0.0.1; the real agent on h1 says its own version."""
    args = {"target": "ssh", "ssh": {"hosts": ["h1"], "config": str(ssh_hosts.config)},
            "jobs_dir": str(tmp_path / "jobs"), "code": "print(1)"}
    code = "from sdp_jupyter.launch import channel\nchannel.version = lambda: '0.0.1'\n" + LAUNCH
    d = ssh_hosts.cluster.popen(0, [sys.executable, "-c", code, json.dumps(args)], env=_env(), text=True,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = next_line(d)["spec_error"]
    assert "this notebook 0.0.1. Fix: install sdp_jupyter 0.0.1 there from a checkout" in err, err
    _has_all(err, "Different versions on different hosts", 0)


def test_an_engine_of_another_protocol_version_is_named():
    """A peer that greets with protocol version 2: the engine refuses it and says why."""
    from sdp_jupyter import _engine

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def greet():  # isend connects in the caller's thread: the peer answers from its own
        conn, _ = server.accept()
        conn.sendall(struct.pack("<II", 0x48504453, 2) + bytes(32))  # ServerHello: magic, version, nonce
        conn.recv(1)
        conn.close()

    peer = threading.Thread(target=greet, daemon=True)
    peer.start()
    mailbox = _engine.Mailbox(0, 2, b"s" * 32, "127.0.0.1", 5.0, False)
    buf = (ctypes.c_char * 8)()
    try:
        own = mailbox.listen()
        mailbox.set_peers(["127.0.0.1", "127.0.0.1"], [own, server.getsockname()[1]])
        with pytest.raises(Exception) as err:
            mailbox.wait(mailbox.isend(1, 7, ctypes.addressof(buf), 8))
    finally:
        mailbox.shutdown()
        server.close()
        peer.join(5)
    text = str(err.value)
    assert "speaks protocol version 2, this engine speaks 1: install the same sdp_jupyter everywhere" in text, text
    _has_all(text, "Different versions on different hosts", 1)


# --------------------------------------------------------------------- ranks trained independently
def test_ranks_that_never_talk_are_said_to_have_trained_independently(tmp_path, jobs_dir):
    script = _write(tmp_path / "alone.py", """
        import torch
        model = torch.nn.Linear(4, 1)
        model(torch.ones(2, 4)).sum().backward()
    """)
    job = launch(script, nodes=2, name="alone")
    assert job.wait(120) == "succeeded", job.summary()
    _has_all(job.summary(), "The ranks trained independently", 0)


def test_ranks_that_each_made_a_world_of_one_are_said_to_have_trained_independently(tmp_path, jobs_dir):
    """Each rank's own group (world_size=1, rank=0): its all_reduce runs, and averages nothing."""
    script = _write(tmp_path / "own_world.py", f"""
        import os, torch, torch.distributed as dist
        dist.init_process_group("smddp", init_method="file://{tmp_path}/group-" + os.environ["RANK"],
                                world_size=1, rank=0)
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    """)
    job = launch(script, nodes=2, name="own-world")
    assert job.wait(120) == "succeeded", job.summary() + job.logs(0)
    _has_all(job.summary(), "The ranks trained independently", 1)
    talked = launch(_write(tmp_path / "talked.py", """
        import torch, torch.distributed as dist
        dist.init_process_group("smddp")
        dist.all_reduce(torch.ones(2))
    """), nodes=2, name="talked")
    assert talked.wait(120) == "succeeded" and talked.warnings == [], talked.summary()


# ----------------------------------------------------------------------------------- warm -> cold
def test_a_pool_that_must_not_fork_starts_the_job_cold_and_says_why(tmp_path, jobs_dir, monkeypatch):
    """A preloaded module that starts a thread: the pool refuses to fork, every rank starts cold."""
    from sdp_jupyter.launch.kernel import warm_pool

    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "mods"), os.environ["PYTHONPATH"]]))
    warm_pool.shutdown()
    try:
        job = launch(_write(tmp_path / "w.py", "print('hello')\n"), nodes=2, start="warm",
                     preload=["starts_a_thread"], name="warm")
        assert job.wait(120) == "succeeded", job.summary()
    finally:
        warm_pool.shutdown()
    assert job.status["start"] == "cold", job.status
    _has_all(job.summary(), "A warm start fell back to cold")


# --------------------------------------------------------------------------------------- a signal
def test_a_rank_killed_by_a_signal_is_named_with_its_collective(tmp_path, jobs_dir):
    """The crash of tests/launch/test_launch_e2e.py (which checks the log too), as the page quotes it."""
    from test_launch_e2e import CRASH_IN_A_COLLECTIVE

    job = launch(_write(tmp_path / "crash.py", CRASH_IN_A_COLLECTIVE), nodes=2, name="segv")
    assert job.wait(120) == "failed", job.summary()
    _has_all(job.error, "A rank was killed by a signal")


# ----------------------------------------------------------------------------------------- a hang
def test_a_stalled_rank_is_named_by_the_collective_that_waits_for_it():
    outs = _ranks("""
        import time, torch, torch.distributed as dist
        dist.init_process_group("smddp")
        if dist.get_rank() == 0:
            dist.all_reduce(torch.ones(4))
        else:
            time.sleep(6)
    """, 2, SDP_TIMEOUT="3")
    _has_all(outs[0], "A job hangs")
