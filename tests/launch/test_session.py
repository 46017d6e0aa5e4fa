"""Interactive sessions (launch/kernel/session.py) without a kernel: the refusals before anything
starts, the failed cell's message, and a session on the SSH test hosts (cells through the agents)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from helpers.remote_jobs import REPO, next_line
from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch.kernel import session as sessions


@pytest.mark.parametrize("spec, option", [
    (JobSpec(code="pass", target="sagemaker", sagemaker={"instance_type": "ml.c5.xlarge"}), "--target"),
    (JobSpec(code="pass", max_restarts=1), "--max-restarts"),
    (JobSpec(code="pass", result="x"), "--result"),
])
def test_what_a_session_cannot_be_is_refused_before_anything_starts(spec, option, jobs_dir):
    with pytest.raises(SpecError) as e:
        sessions.Session.start(spec)
    assert e.value.option == option and "Fix" in str(e.value) or "%%sdp_px" in str(e.value)
    assert not any(jobs_dir.iterdir())


def test_a_failed_cell_names_the_rank_that_raised_before_the_ranks_it_left_waiting():
    result = sessions.CellResult(7, [0, 1, 2, 3], causes=[2])
    result.answers = {0: {"ok": False, "error": "SmddpBackendError: rank 2 shut down its process group"},
                      1: {"ok": True}, 2: {"ok": False, "error": "Traceback...\nValueError: bad"},
                      3: {"ok": False, "interrupted": True, "error": "KeyboardInterrupt"}}
    text = result.message()
    assert text.splitlines()[0] == "the cell failed on rank(s) 0, 2, 3"
    assert text.index("rank 2 failed:\nTraceback") < text.index("rank 0 failed: SmddpBackendError")
    assert "rank 3 interrupted: KeyboardInterrupt" in text and text.endswith("The session is still up.")
    assert result.failed == [0, 2, 3] and result.interrupted == [3]
    assert sessions.CellResult(1, [0, 1], answers={0: {"ok": True}, 1: {"ok": True}}).message() == ""


# Plays the notebook on h0: a session on the SSH hosts, cells through the agents, one JSON line per step.
DRIVER = r'''
import json, os, signal, socket, sys, threading
from sdp_jupyter.launch import JobSpec
from sdp_jupyter.launch.kernel import session as sessions
args = json.loads(sys.argv[1])
s = sessions.start(JobSpec(code="pass", **args))
say = lambda **kw: print(json.dumps(kw), flush=True)
say(ready=s.status())
r = s.run("import socket, torch, torch.distributed as dist\nt = torch.ones(256) * (dist.get_rank() + 1)\n"
          "dist.all_reduce(t)\n(socket.gethostname(), t[0].item())", want="gather")
say(gather=[r.value(i) for i in range(3)], failed=r.failed, seconds=r.seconds)
r = s.run("if dist.get_rank() == 2:\n    raise RuntimeError('host three is unhappy')\ndist.all_reduce(t)\n")
say(failed=r.failed, message=r.message())
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    s.run("import time\nwhile True:\n    time.sleep(0.05)\n")
    say(interrupted=False)
except KeyboardInterrupt:
    say(interrupted=True, message=s.last.message())
r = s.run("t = torch.ones(4)\ndist.all_reduce(t)\nt.sum().item()", want="result")
say(after=r.value(0), failed=r.failed)
say(stopped=s.stop(), error=s.job.error)
'''


@pytest.mark.slow
def test_a_session_on_the_ssh_hosts_keeps_its_ranks_between_cells(ssh_hosts, hosts, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    args = {"target": "ssh", "ssh": {"hosts": ssh_hosts.hosts, "config": str(ssh_hosts.config)},
            "jobs_dir": str(tmp_path / "jobs")}
    proc = ssh_hosts.cluster.popen(0, [sys.executable, "-c", DRIVER, json.dumps(args)], env=env, text=True,
                                   stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready = next_line(proc)["ready"]
        assert ready["alive"] and sorted(set(ready["hosts"].values())) == ["h1", "h2", "h3"], ready
        line = next_line(proc)
        assert line["failed"] == [] and [v for _, v in line["gather"]] == [6.0] * 3, line
        assert [h for h, _ in line["gather"]] == ["h1", "h2", "h3"]
        line = next_line(proc)
        assert 2 in line["failed"] and "RuntimeError: host three is unhappy" in line["message"], line
        assert "process group reconnected" in line["message"]
        line = next_line(proc)
        assert line["interrupted"] and "interrupted on rank(s) 0, 1, 2" in line["message"], line
        line = next_line(proc)
        assert line == {"after": 12.0, "failed": []}, line
        line = next_line(proc)
        assert line["stopped"] == "succeeded", line
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert ssh_hosts.wait_clean(10) == {}
