"""Notebook code on the SSH test hosts (issue 62): a driver on h0 plays the notebook (its `__main__` is
the notebook's, so what it defines goes by value, as a notebook's does) and runs on h1..h2."""
from __future__ import annotations

import pytest

from helpers.remote_jobs import RUN_FUNCTION, drive, next_line

pytestmark = pytest.mark.slow

BY_VALUE = r'''
import json, sys, sdp_jupyter
args = json.loads(sys.argv[1])
args.pop("code")
SCALE = 3
class Net:
    def forward(self, x):
        return x * SCALE
def helper(x):
    return x + 1
job = sdp_jupyter.launch(code="import socket\n[socket.gethostname(), Net().forward(5), helper(1)]",
                         push={"Net": Net, "helper": helper}, backend="gloo", **args)
job.wait()
print(json.dumps({"state": job.state, "error": job.error,
                  "result": job.result() if job.state == "succeeded" else None}), flush=True)
'''


def _args(ssh_hosts, jobs) -> dict:
    return {"target": "ssh", "ssh": {"hosts": ssh_hosts.hosts[:2], "config": str(ssh_hosts.config)},
            "jobs_dir": str(jobs)}


def test_notebook_classes_and_functions_go_by_value_to_ssh_hosts(ssh_hosts, tmp_path):
    out = next_line(drive(ssh_hosts.cluster, _args(ssh_hosts, tmp_path / "jobs"), driver=BY_VALUE))
    assert out["state"] == "succeeded", out
    assert out["result"] == ["h1", 15, 2], out  # rank 0 on h1: Net read SCALE, helper came along
    assert ssh_hosts.wait_clean(10) == {}


def test_run_a_notebook_function_on_ssh_hosts(ssh_hosts, tmp_path):
    out = next_line(drive(ssh_hosts.cluster, _args(ssh_hosts, tmp_path / "jobs"), driver=RUN_FUNCTION))
    assert out["values"] == [[0, "h1", 2, 60], [1, "h2", 2, 60]], out
    assert ssh_hosts.wait_clean(10) == {}
