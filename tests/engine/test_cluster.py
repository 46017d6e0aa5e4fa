"""Cluster in a box (issue 13): the test hosts themselves, the engine across them, and faults on
real links. One 4-host cluster serves the whole module (tests/helpers/cluster.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.ranks import assert_all_ok, collect, run_ranks, start_ranks
from test_engine import check

pytestmark = pytest.mark.slow
SECRET = "cluster-test-secret-0123456789abcdef"


def on_hosts(c, per_host):
    """wrap(rank) for helpers.ranks: rank r runs on host r // per_host."""
    return lambda r: c.enter(r // per_host)


# ---------------------------------------------------------------- the hosts

def test_hosts_are_really_separate(hosts):
    names = [hosts.run(h, ["hostname"]).stdout.strip() for h in range(hosts.n)]
    assert names == ["h0", "h1", "h2", "h3"]
    hosts.run(0, ["sh", "-c", "echo mine > /dev/shm/sdp-test-probe"])
    try:
        assert "sdp-test-probe" not in hosts.run(1, ["ls", "/dev/shm"]).stdout
        assert not os.path.exists("/dev/shm/sdp-test-probe")
        assert "sdp-test-probe" in hosts.run(0, ["ls", "/dev/shm"]).stdout
    finally:
        hosts.run(0, ["rm", "-f", "/dev/shm/sdp-test-probe"])
    # each host resolves the others by name, and traffic crosses the links
    before = [hosts.bytes(h) for h in range(hosts.n)]
    # an echo server on h3 that reads all 50,000 bytes (they arrive in pieces over the shaped link)
    # before it answers; the client on h0 reaches it by host name
    srv = hosts.popen(3, [sys.executable, "-c", "import socket\ns=socket.create_server(('0.0.0.0',7001))\n"
                          "c,_=s.accept()\nbuf=b''\nwhile len(buf)<50000:\n  d=c.recv(65536)\n  if not d: break\n"
                          "  buf+=d\nc.sendall(buf)\nc.close()"])
    try:
        out = hosts.run(0, [sys.executable, "-c", "import socket,time\nfor i in range(100):\n  try:\n"
                            "    s=socket.create_connection(('h3',7001));break\n  except OSError: time.sleep(0.05)\n"
                            "s.sendall(b'x'*50000)\nn=0\nwhile n<50000:\n  d=s.recv(65536)\n  if not d: break\n"
                            "  n+=len(d)\nprint(n)"])
        assert out.stdout.strip() == "50000"
    finally:
        srv.kill()
    after = [hosts.bytes(h) for h in range(hosts.n)]
    assert after[0]["tx"] - before[0]["tx"] >= 50000 and after[3]["rx"] - before[3]["rx"] >= 50000


def test_closing_shuts_the_hosts_down_sigterm_first(hosts, tmp_path):
    """What a process removes on SIGTERM is gone after close() (a warm pool's socket folder, in the
    /tmp the hosts share with this machine); one that ignores SIGTERM is still killed. Another cluster
    of this process (the module's `hosts`) lives on through both the start and the close."""
    from sdp_jupyter.testing.cluster import Cluster

    mark = tmp_path / "removed-on-sigterm"
    mark.touch()
    polite = ("import os, signal, sys, time\n"
              f"signal.signal(signal.SIGTERM, lambda *a: (os.unlink({str(mark)!r}), sys.exit(0)))\n"
              "print('up', flush=True)\ntime.sleep(300)")
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(300)"
    with Cluster(hosts=1, rate=None) as c:
        procs = [c.popen(0, [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for code in (polite, stubborn)]
        assert [p.stdout.readline().strip() for p in procs] == ["up", "up"]
    assert [p.wait(timeout=10) for p in procs] == [0, -signal.SIGKILL]
    assert not mark.exists()
    assert [hosts.run(h, ["hostname"]).stdout.strip() for h in range(hosts.n)] == ["h0", "h1", "h2", "h3"]


def test_shape_cut_heal(hosts):
    hosts.shape(1, "10mbit")
    hosts.cut(2)
    r = hosts.run(0, [sys.executable, "-c", "import socket\ntry:\n socket.create_connection(('h2',22),timeout=1)\n"
                      "except OSError as e: print(type(e).__name__)"], timeout=10)
    assert r.stdout.strip() in ("TimeoutError", "timeout", "OSError", "ConnectionRefusedError") or r.stdout.strip()
    hosts.heal(2)
    qdisc = os.popen(f"tc -n {hosts.host_ns[1]} qdisc show dev eth0").read()
    assert "tbf" in qdisc and "10Mbit" in qdisc


# ---------------------------------------------------------------- the engine across hosts

CASES = [("all_reduce", 1001, "float32", "sum", 0), ("all_reduce", 7, "float16", "avg", 0),
         ("all_reduce", 1001, "int32", "max", 0), ("all_reduce", 5000, "float64", "product", 0),
         ("reduce", 1001, "float32", "sum", 1), ("broadcast", 1001, "int64", None, 1),
         ("all_gather", 33, "float32", None, 0), ("reduce_scatter", 17, "float32", "sum", 0),
         ("all_reduce", 3_000_000, "float32", "sum", 0), ("ring", 1_000_000, "float64", None, 0),
         ("barrier", 0, "float32", None, 0)]


@pytest.mark.parametrize("n_hosts,per_host", [(2, 1), (2, 2), (4, 1), (3, 2)])
def test_engine_across_hosts_matches_numpy(hosts, n_hosts, per_host):
    world = n_hosts * per_host
    before = [hosts.bytes(h)["tx"] for h in range(n_hosts)]
    results = run_ranks("engine_workers:collectives", world, per_host, args=(CASES,), timeout=120, secret=SECRET,
                        wrap=on_hosts(hosts, per_host), master_addr=hosts.addresses[0],
                        env={"SDP_TIMEOUT": "30"})
    vals = check(results, CASES, world)
    assert [v["num_nodes"] for v in vals] == [n_hosts] * world
    sent = [hosts.bytes(h)["tx"] - before[h] for h in range(n_hosts)]
    assert all(s > 3_000_000 for s in sent), f"bytes sent per host {sent}: gradients must cross every link"


def test_nodes_told_apart_by_hostname_alone(hosts):
    """No GROUP_RANK: the engine groups ranks by host name, which now differs per host."""
    results = run_ranks("engine_workers:collectives", 4, 2, args=(CASES[:3],), timeout=120, secret=SECRET,
                        wrap=on_hosts(hosts, 2), master_addr=hosts.addresses[0],
                        env={"GROUP_RANK": "", "SDP_TIMEOUT": "30"})
    vals = check(results, CASES[:3], 4)
    assert [(v["node"], v["local_rank"]) for v in vals] == [(0, 0), (0, 1), (1, 0), (1, 1)]


# ---------------------------------------------------------------- faults on real links

def _wait_ready(procs, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        logs = []
        for p in procs:
            p.log.seek(0)
            logs.append(p.log.read())
        if all("ready" in t for t in logs):
            return
        time.sleep(0.1)
    raise AssertionError(f"ranks never got ready: {logs}")


def test_link_cut_mid_all_reduce_is_named_everywhere(hosts):
    timeout = 4
    procs, tmp = start_ranks("engine_workers:all_reduce_until_error", 4, 2, args=(1 << 20, 60), secret=SECRET,
                             wrap=on_hosts(hosts, 2), master_addr=hosts.addresses[0],
                             env={"SDP_TIMEOUT": str(timeout)})
    _wait_ready(procs)
    t_cut = time.monotonic()
    hosts.cut(1)
    results = collect(procs, tmp, timeout=timeout + 30)
    took = time.monotonic() - t_cut
    errors = [r.value["error"] if r.ok else r.error for r in results]
    assert all(e != "no error" for e in errors), errors
    for r in results:
        assert r.ok and r.value["after"] > 0, (r.error, r.output[-1500:])
        assert r.value["after"] < 60
    # every rank names the other side: ranks on host 0 name rank 2 (leader of node 1), and back
    assert all("rank 2" in e for e in errors[:2]), errors
    assert all("rank 0" in e for e in errors[2:]), errors
    assert took < timeout + 2 + 8, f"the cut was reported after {took:.1f} s"


def test_slow_link_makes_progress_without_false_failure(hosts):
    hosts.shape(1, "10mbit")
    results = run_ranks("engine_workers:all_reduce_timed", 2, 1, args=(256 << 10, 3), timeout=120, secret=SECRET,
                        wrap=on_hosts(hosts, 1), master_addr=hosts.addresses[0], env={"SDP_TIMEOUT": "20"})
    vals = assert_all_ok(results)
    # 1 MiB of float32 each way per all_reduce over 10 Mbit/s: about a second each
    assert all(v["first"] == 2.0 for v in vals)
    assert all(v["took"] > 0.5 for v in vals), vals


def test_every_process_of_a_host_killed_is_named(hosts):
    procs, tmp = start_ranks("engine_workers:all_reduce_until_error", 4, 2, args=(4096, 60), secret=SECRET,
                             wrap=on_hosts(hosts, 2), master_addr=hosts.addresses[0], env={"SDP_TIMEOUT": "10"})
    _wait_ready(procs)
    killed = hosts.kill_host(1)
    assert killed
    results = collect(procs, tmp, timeout=40)
    for r in results[:2]:
        assert r.ok, (r.error, r.output[-1500:])
        assert "rank 2" in r.value["error"] or "rank 3" in r.value["error"], r.value
        assert r.value["after"] < 10
    assert hosts.pids(1) == []
