"""A session whose host is gone for good (launch/kernel/session.py: shrink): on the SSH test hosts h1..h3,
the notebook on h0, the agent and rank of h3 SIGKILLed, or h3's link cut, while a cell runs collectives. The cell's error
names the rank and what it lost; cells are refused until the user chooses; `shrink` makes the process
group again of the two ranks left, which kept their variables; stop leaves nothing behind."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from helpers.remote_jobs import REPO, next_line
from sdp_jupyter.testing.cluster import signal_all

DRIVER = r'''
import json, sys, time
from sdp_jupyter.launch import JobSpec
from sdp_jupyter.launch.kernel import session as sessions
say = lambda **kw: print(json.dumps(kw), flush=True)
s = sessions.start(JobSpec(code="pass", **json.loads(sys.argv[1])))
r = s.run("import time, torch, torch.distributed as dist\nx = dist.get_rank() * 10\nt = torch.ones(4)\n"
          "dist.all_reduce(t)\nt[0].item()", want="gather")
say(ready=[r.value(i) for i in range(3)], failed=r.failed)
sys.stdin.readline()
say(looping=True)
r = s.run("for _ in range(600):\n    dist.all_reduce(t)\n    time.sleep(0.05)\n")
say(failed=r.failed, message=r.message(), seconds=r.seconds)
try:
    s.run("1")
    say(refused=None)
except sessions.SessionError as e:
    say(refused=str(e))
t0 = time.monotonic()
rec = s.shrink()
say(notes=rec.notes, members=s.members, seconds=time.monotonic() - t0)
r = s.run("t = torch.ones(4)\ndist.all_reduce(t)\n(x, dist.get_rank(), dist.get_world_size(), t[0].item(), sdp_members)",
          want="gather")
say(after=[r.value(i) for i in s.members], failed=r.failed, shown=sessions.describe(s.status()))
r = s.run("y = torch.full((2,), float(x))\ndist.broadcast(y, 1, group=sdp_group)\ny[0].item()", ranks=[0, 1],
          want="gather")
say(group=[r.value(i) for i in s.members], failed=r.failed)
say(stopped=s.stop(), error=s.job.error)
'''


@pytest.mark.slow
@pytest.mark.parametrize("how", ["killed", "cut"])
def test_a_session_goes_on_with_fewer_ranks_after_a_host_is_gone(ssh_hosts, hosts, tmp_path, how):
    # a cut link sends no error: the survivors leave their collective with h3 at its deadline (SDP_TIMEOUT,
    # 20 s here: after the link's loss is known, ~3-10 s), and the shrink waits for that
    args = {"target": "ssh", "ssh": {"hosts": ssh_hosts.hosts, "config": str(ssh_hosts.config)},
            "jobs_dir": str(tmp_path / "jobs"), "env": {"SDP_TIMEOUT": "20"} if how == "cut" else {}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    proc = ssh_hosts.cluster.popen(0, [sys.executable, "-c", DRIVER, json.dumps(args)], env=env, text=True,
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.jobs_dir = args["jobs_dir"]
    try:
        line = next_line(proc, timeout=180)
        assert line == {"ready": [3.0, 3.0, 3.0], "failed": []}, line
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert next_line(proc)["looping"]
        delay = random.uniform(0.3, 3.0)
        time.sleep(delay)  # at some moment inside the cell's collectives
        if how == "killed":  # its agent and rank: the host is gone as far as the session can tell
            doomed = ssh_hosts.processes(3) + ssh_hosts.processes(3, "sdp_jupyter.launch.host.agent")
            assert doomed
            signal_all(doomed, signal.SIGKILL)
        else:  # silent: no error reaches anyone; the agent's heartbeat is what tells
            hosts.cut(3)
        line = next_line(proc)
        print(f"[{how}] the cell ended {line['seconds'] - delay:.1f} s after the loss")
        msg = line["message"]
        assert 2 in line["failed"] and msg.startswith("rank 2 died during the cell"), line
        assert "rank 2 (node 2 on host h3, local rank 0) was lost with its host: " in msg, msg
        assert "has not answered for 10 s" in msg or "the ssh connection closed (ssh exit 255" in msg, msg
        assert "every variable they had with them" in msg and "%sdp_session shrink" in msg, msg
        line = next_line(proc)
        assert "were lost with their host" in line["refused"] and "%sdp_session shrink" in line["refused"], line
        line = next_line(proc, timeout=150)
        print(f"[{how}] shrink took {line['seconds']:.1f} s")
        assert line["members"] == [0, 1], line
        assert any(n.startswith("2 rank(s) go on (0, 1): the process group was made again") for n in line["notes"]), line
        assert any("rank(s) [2] left" in n for n in line["notes"]), line
        line = next_line(proc)
        assert line["failed"] == [] and line["after"] == [[0, 0, 2, 2.0, [0, 1]], [10, 1, 2, 2.0, [0, 1]]], line
        shown = line["shown"]
        assert ": running, 2 of 3 ranks, " in shown.splitlines()[0], shown
        assert "rank 2: left the session (on h3): rank 2 (node 2 on host h3, local rank 0) was lost" in shown, shown
        line = next_line(proc)
        assert line == {"group": [10.0, 10.0], "failed": []}, line
        line = next_line(proc)
        assert line["stopped"] == "succeeded", line
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        hosts.heal(3)  # its agent has stopped its rank, having lost the notebook
    assert ssh_hosts.wait_clean(20) == {}


def test_shrink_without_a_lost_host_is_refused_and_the_session_goes_on(jobs_dir):
    from sdp_jupyter.launch import JobSpec
    from sdp_jupyter.launch.kernel import session as sessions

    s = sessions.Session.start(JobSpec(code="pass", nodes=2))
    try:
        with pytest.raises(sessions.SessionError, match="no rank was lost with its host, so there is nothing to shrink"):
            s.shrink()
        r = s.run("import torch.distributed as dist\n(dist.get_rank(), dist.get_world_size(), sdp_members)", want="gather")
        assert [r.value(i) for i in range(2)] == [(0, 2, [0, 1]), (1, 2, [0, 1])], r.message()
    finally:
        assert s.stop() == "succeeded"
