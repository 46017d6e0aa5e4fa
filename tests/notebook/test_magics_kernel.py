"""The magics in a real ipykernel: the job view widget, and no worker left after restart/shutdown."""
from __future__ import annotations

import os
import signal
import time

import pytest

from conftest import wait_no_processes, worker_processes
from helpers.kernel import execute
from tools.executed import kernel_env

pytestmark = pytest.mark.slow

SLEEPER = """%%sdp_train --nodes 2 --backend gloo --name {name}
import time
print("up", flush=True)
time.sleep(300)
"""


def wait_workers(root, n, timeout=60):
    deadline = time.monotonic() + timeout
    while len(worker_processes(root)) < n and time.monotonic() < deadline:
        time.sleep(0.1)
    return worker_processes(root)


def test_job_view_and_no_worker_after_restart_or_shutdown(jobs_dir, tmp_path):
    from jupyter_client.manager import start_new_kernel

    env = kernel_env()
    env["SDP_JOBS_DIR"] = str(jobs_dir)
    km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
    try:
        reply, _ = execute(kc, "%load_ext sdp_jupyter")
        assert reply["status"] == "ok"
        reply, messages = execute(kc, SLEEPER.format(name="k1"))
        assert reply["status"] == "ok", reply
        shown = [m for m in messages if m["msg_type"] in ("display_data", "execute_result")]
        assert any("application/vnd.jupyter.widget-view+json" in m["content"]["data"] for m in shown), \
            "the cell did not show the job view widget"
        assert len(wait_workers(jobs_dir, 2)) == 2
        # output goes to the view's Output widget (comm messages), never to a later cell's stream
        reply, messages = execute(kc, "import time; time.sleep(1); print('other cell')")
        streams = "".join(m["content"].get("text", "") for m in messages if m["msg_type"] == "stream")
        assert streams == "other cell\n"

        km.restart_kernel(now=False)  # asks the kernel to shut down, then starts a new one
        assert wait_no_processes(jobs_dir) == []
        kc.stop_channels()
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        execute(kc, "%load_ext sdp_jupyter")
        execute(kc, SLEEPER.format(name="k2"))
        assert len(wait_workers(jobs_dir, 2)) == 2
        km.shutdown_kernel(now=False)
        assert wait_no_processes(jobs_dir) == []

        kc.stop_channels()
        km, kc = start_new_kernel(kernel_name="python3", env=env, cwd=str(tmp_path))
        execute(kc, "%load_ext sdp_jupyter")
        execute(kc, SLEEPER.format(name="k3"))
        assert len(wait_workers(jobs_dir, 2)) == 2
        os.kill(km.provisioner.pid, signal.SIGKILL)  # SIGKILL: no atexit; the parent-death signal takes the workers along
        assert wait_no_processes(jobs_dir) == []
    finally:
        kc.stop_channels()
        if km.is_alive():
            km.shutdown_kernel(now=True)
