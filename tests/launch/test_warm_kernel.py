"""Warm starts in a real ipykernel: the first %%sdp_train job of a kernel is cold and the next warm,
%sdp_warm makes the first one warm, --cold forces a cold start, and the pool dies with the kernel."""
from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

from helpers.kernel import execute
from sdp_jupyter.jobdir import log_path
from tools.executed import kernel_env

pytestmark = pytest.mark.slow

JOB = """%%sdp_train --nodes 2 --backend gloo --name {name} --wait {options}
import os, sys
print("wave preloaded:", "wave" in sys.modules)
"""


def stream(messages) -> str:
    return "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")


def run_ok(kc, code, timeout=120) -> str:
    reply, messages = execute(kc, code, timeout=timeout)
    assert reply["status"] == "ok", (reply, stream(messages))
    return stream(messages)


def status(jobs_dir, name) -> dict:
    return json.loads((jobs_dir / name / "status.json").read_text())


def rank0_log(jobs_dir, name) -> str:
    path = log_path(jobs_dir / name, 0)
    return path.read_text() if path.is_file() else ""


def pool_pid(kc) -> int:
    return int(run_ok(kc, "from sdp_jupyter.launch.kernel import warm_pool; print(warm_pool._POOL.proc.pid)").strip())


def gone(pids, timeout=15.0) -> list:
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.fixture
def kernel(jobs_dir, tmp_path):
    from jupyter_client.manager import start_new_kernel

    env = kernel_env()
    env["SDP_JOBS_DIR"] = str(jobs_dir)
    env.pop("SDP_WARM", None)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    run_ok(kc, "%load_ext sdp_jupyter")
    yield km, kc
    kc.stop_channels()
    if km.is_alive():
        km.shutdown_kernel(now=True)


def test_first_job_of_a_kernel_is_cold_the_next_warm_and_cold_forces_cold(kernel, jobs_dir):
    km, kc = kernel
    out = run_ok(kc, JOB.format(name="first", options=""))
    assert status(jobs_dir, "first")["start"] == "cold" and "start_reason" not in status(jobs_dir, "first")
    assert "Job first: succeeded" in out and "backend gloo (no process group), cold start, restarts 0)" in out

    out = run_ok(kc, JOB.format(name="second", options=""))  # the pool started after the first job
    assert status(jobs_dir, "second")["start"] == "warm", status(jobs_dir, "second")
    assert "backend gloo (no process group), warm start, restarts 0)" in out
    assert "wave preloaded: False" in rank0_log(jobs_dir, "second")  # not preloaded: not there
    pool = pool_pid(kc)

    out = run_ok(kc, JOB.format(name="third", options="--cold"))
    assert status(jobs_dir, "third")["start"] == "cold" and "cold start" in out
    out = run_ok(kc, JOB.format(name="fourth", options="--warm --preload wave"))  # a new module: a new pool
    assert status(jobs_dir, "fourth")["start"] == "warm" and "wave preloaded: True" in rank0_log(jobs_dir, "fourth")
    assert not psutil.pid_exists(pool) or psutil.Process(pool).status() == psutil.STATUS_ZOMBIE
    pool = pool_pid(kc)

    km.shutdown_kernel(now=False)
    assert gone([pool]) == []


def test_sdp_warm_makes_the_first_job_warm_and_killing_the_kernel_leaves_nothing(kernel, jobs_dir):
    km, kc = kernel
    out = run_ok(kc, "%sdp_warm wave")
    assert "warm pool ready in" in out and "wave" in out and "start warm" in out, out
    reply, messages = execute(kc, "%sdp_warm 1wave")
    assert reply["status"] == "error" and "%sdp_warm: '1wave' is not a module name" in reply["evalue"]

    out = run_ok(kc, JOB.format(name="first", options=""))
    assert status(jobs_dir, "first")["start"] == "warm" and "wave preloaded: True" in rank0_log(jobs_dir, "first")
    assert "warm start" in out

    # a job left running (no --wait), then the kernel is killed: no pool, no rank left behind
    run_ok(kc, '%%sdp_train --nodes 2 --backend gloo --name sleeper\n'
               'import time\nprint("up", flush=True)\ntime.sleep(300)\n')
    deadline = time.monotonic() + 60
    # a forked rank 0 can print before rank 1 has started and the ranks' pids are written; how they
    # started ("start") is written once every node's agent has said so, after its ranks' pids
    while "up" not in rank0_log(jobs_dir, "sleeper") or len(status(jobs_dir, "sleeper").get("pids") or []) < 2 \
            or "start" not in status(jobs_dir, "sleeper"):
        assert time.monotonic() < deadline, "the warm job did not start"
        time.sleep(0.1)
    st = status(jobs_dir, "sleeper")
    assert st["start"] == "warm"
    pids = [pool_pid(kc)] + st["pids"]
    assert all(psutil.pid_exists(p) for p in pids)
    folder = os.path.dirname(run_ok(kc, "print(warm_pool._POOL.path)").strip())
    assert os.path.isdir(folder)
    os.kill(km.provisioner.pid, signal.SIGKILL)  # no atexit: the parent-death signals take them along
    assert gone(pids) == []
    assert not os.path.exists(folder)  # nor the pool's socket folder
