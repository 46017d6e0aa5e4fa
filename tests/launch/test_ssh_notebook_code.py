"""Notebook code on the SSH test hosts (issue 62): a driver on h0 plays the notebook (its `__main__` is
the notebook's, so what it defines goes by value, as a notebook's does) and runs on h1..h2."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.remote_jobs import REPO, next_line

pytestmark = pytest.mark.slow

# the notebook: a class reading a notebook global, a helper, a function that uses both
NOTEBOOK = r'''
import json, os, sys, sdp_jupyter
args = json.loads(sys.argv[1])
SCALE = 3
class Net:
    def forward(self, x):
        return x * SCALE
def helper(x):
    return x + 1
def f(n, scale=1):
    import socket, torch.distributed as dist
    return [int(os.environ["RANK"]), socket.gethostname(), dist.get_world_size(), Net().forward(n) * scale]
'''

BY_VALUE = NOTEBOOK + r'''
job = sdp_jupyter.launch(code="import socket\n[socket.gethostname(), Net().forward(5), helper(1)]",
                         push={"Net": Net, "helper": helper}, backend="gloo", **args)
job.wait()
print(json.dumps({"state": job.state, "error": job.error, "result": job.result() if job.state == "succeeded" else None}))
'''

RUN = NOTEBOOK + r'''
print(json.dumps({"values": sdp_jupyter.run(f, args=(10,), kwargs={"scale": 2}, **args)}), flush=True)
'''


def _notebook(ssh_hosts, code: str, jobs) -> subprocess.Popen:
    args = {"target": "ssh", "ssh": {"hosts": ssh_hosts.hosts[:2], "config": str(ssh_hosts.config)},
            "jobs_dir": str(jobs)}
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = ssh_hosts.cluster.popen(0, [sys.executable, "-c", code, json.dumps(args)], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.jobs_dir = str(jobs)
    return proc


def test_notebook_classes_and_functions_go_by_value_to_ssh_hosts(ssh_hosts, tmp_path):
    out = next_line(_notebook(ssh_hosts, BY_VALUE, tmp_path / "jobs"))
    assert out["state"] == "succeeded", out
    assert out["result"] == ["h1", 15, 2], out  # rank 0 on h1: Net read SCALE, helper came along
    assert ssh_hosts.wait_clean(10) == {}


def test_run_a_notebook_function_on_ssh_hosts(ssh_hosts, tmp_path):
    out = next_line(_notebook(ssh_hosts, RUN, tmp_path / "jobs"))
    assert out["values"] == [[0, "h1", 2, 60], [1, "h2", 2, 60]], out
    assert ssh_hosts.wait_clean(10) == {}
