"""A barrier every rank reached does not fail because a rank that passed it has already shut down.

A rank can be preempted between seeing a barrier incomplete and probing its node's connections
(on a host with more ranks than cores, for a long time): the last rank may then arrive, finish the
collective and exit, and the probe sees its connection closed. Found once in benchmarks/cluster.py
(16 ranks on 2 cores: "rank 12 (node 3) exited or closed its connection during all_reduce #18"
although rank 12 had finished that all_reduce). Here strace makes the window wide on purpose: it
delays every poll() of rank 1 (the probe's first system call) by 3 s."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest

from helpers.ranks import collect, start_ranks

pytestmark = pytest.mark.slow


@pytest.mark.skipif(shutil.which("strace") is None or os.geteuid() != 0, reason="needs strace and root (ptrace)")
def test_a_reached_barrier_survives_the_leader_shutting_down(tmp_path):
    procs, tmp = start_ranks("engine_workers:leader_leaves_after_last_barrier", 2, 2, (str(tmp_path),))
    tracer = None
    try:
        pid_file = tmp_path / "pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "the ranks did not start"
            time.sleep(0.05)
        tracer = subprocess.Popen(["strace", "-f", "-tt", "-qq", "-o", os.devnull, "-e", "trace=poll,ppoll",
                                   "-e", "inject=poll,ppoll:delay_enter=3000000", "-p", pid_file.read_text()],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(1.0)  # attached (strace stops and resumes every thread of the process)
        assert tracer.poll() is None, tracer.stderr.read().decode()
        (tmp_path / "go").touch()
        results = collect(procs, tmp, timeout=60)
    finally:
        if tracer is not None:
            tracer.terminate()
            tracer.wait(timeout=10)
    for r in results:
        assert r.ok, f"rank {r.rank}: {r.error}\n{r.output[-2000:]}"
        assert r.value == [3.0] * 4
