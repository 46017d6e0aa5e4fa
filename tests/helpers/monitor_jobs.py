"""Helpers (no tests here) shared by the monitor and dashboard tests: real worker processes that call report()."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

WORKER = r'''
import sys, time
import sdp_jupyter
from sdp_jupyter.monitor.reporter import emit, timed

steps, dt, wait = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
total = int(sys.argv[4]) if len(sys.argv) > 4 else None

def batches():
    for i in range(steps):
        time.sleep(wait)          # the "data loader"
        yield i

for i in timed(batches()):
    t = time.perf_counter()
    end = t + dt
    while time.perf_counter() < end:  # the "compute": busy, so the sampler sees CPU load
        pass
    emit("step", comm_time=dt * 0.4, exposed_comm=dt * 0.1, bytes_reduced=4_000_000)
    extra = {"total_steps": total} if total else {}
    sdp_jupyter.report(step=i, samples=16, loss=2.0 / (i + 1), **extra)
'''


def worker_env(job_dir, rank: int, node: int = 0) -> dict:
    env = dict(os.environ)
    env.pop("PYTEST_CURRENT_TEST", None)
    env.update(SDP_JOB_DIR=str(job_dir), RANK=str(rank), GROUP_RANK=str(node))
    return env


def start_workers(job_dir, ranks, steps, dt=0.02, wait=0.0, total=None, nodes=1):
    """Start one real worker process per rank (ranks spread over `nodes`); returns the Popen list."""
    script = os.path.join(str(job_dir), "worker.py")
    os.makedirs(str(job_dir), exist_ok=True)
    with open(script, "w") as f:
        f.write(WORKER)
    args = [str(steps), str(dt), str(wait)] + ([str(total)] if total else [])
    per_node = max(1, ranks // nodes)
    return [subprocess.Popen([sys.executable, script, *args], env=worker_env(job_dir, r, r // per_node))
            for r in range(ranks)]


def start_sampler(job_dir, node=0, *extra):
    return subprocess.Popen([sys.executable, "-m", "sdp_jupyter.monitor.sampler", "--job-dir", str(job_dir),
                             "--node", str(node), *extra],
                            stderr=subprocess.PIPE, text=True, env=worker_env(job_dir, 0, node))


def set_state(job_dir, state: str) -> None:
    path = os.path.join(str(job_dir), "status.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"state": state}, f)
    os.replace(path + ".tmp", path)


def run_job(job_dir, ranks=2, steps=20, dt=0.02, wait=0.0, total=None, sampler=True, state="succeeded"):
    """A finished job directory made by real processes."""
    samp = start_sampler(job_dir) if sampler else None
    procs = start_workers(job_dir, ranks, steps, dt, wait, total)
    for p in procs:
        assert p.wait(timeout=120) == 0
    if samp is not None:
        time.sleep(1.2)  # at least one sample after the workers
        samp.terminate()
        samp.communicate(timeout=10)
    set_state(job_dir, state)
    return job_dir


def lines(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(x) for x in f if x.strip()]


def wait_for(cond, timeout=60.0, every=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
