"""The local target runs every node through the node agent (launch/host/agent.py), as the SSH, Ray and
Slurm targets do: a local job's ranks are children of one agent per node, each agent a child of this
process; an agent that dies takes its node's ranks with it and the job names it (an elastic job starts it
again and goes on); none is left after."""
from __future__ import annotations

import os
import signal
import time

import psutil

from helpers.remote_jobs import ELASTIC_TRAIN
from sdp_jupyter.launch import launch

AGENT = "sdp_jupyter.launch.host.agent"


def _ranks_started(job, n: int, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(job.status.get("pids") or []) < n:
        assert time.monotonic() < deadline and job.state in ("pending", "running"), (job.state, job.error)
        time.sleep(0.05)
    return job.status["pids"]


def _alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_local_jobs_ranks_are_children_of_one_agent_per_node(jobs_dir):
    job = launch(code="import time\ntime.sleep(60)", nodes=2, procs_per_node=2, backend="gloo", start="cold")
    try:
        pids = _ranks_started(job, 4)
        agents = [psutil.Process(pid).ppid() for pid in pids]
        assert agents[0] == agents[1] != agents[2] == agents[3], agents  # node 0's two ranks, node 1's two
        for agent in {agents[0], agents[2]}:
            process = psutil.Process(agent)
            assert process.cmdline()[-1] == AGENT and process.ppid() == os.getpid(), process.cmdline()
    finally:
        job.stop()
    assert job.wait(30) == "stopped"
    deadline = time.monotonic() + 10
    while _alive(pids + agents) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids + agents) == []


def test_a_killed_agent_takes_its_ranks_and_the_job_names_it(jobs_dir):
    job = launch(code="import time\ntime.sleep(60)", nodes=2, backend="gloo", start="cold")
    pids = _ranks_started(job, 2)
    agent = psutil.Process(pids[1]).ppid()
    os.kill(agent, signal.SIGKILL)
    assert job.wait(30) == "failed"
    assert job.error.startswith(f"host localhost/1 (node 1): its agent (pid {agent}) was killed by signal SIGKILL, "
                                "and its ranks with it"), job.error
    assert job.error.endswith("Fix: --nodes 2:2 makes the job elastic: a killed node agent is started again and "
                              "the job goes on from its checkpoint, spending no --max-restarts"), job.error
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids) == []  # rank 1 by its parent-death signal, rank 0 stopped by its agent


def test_an_elastic_local_job_starts_a_killed_agent_again_and_resumes_from_its_checkpoint(jobs_dir):
    """--nodes 2:3 on the local target: node 1's agent is SIGKILLed mid-training (its ranks die with it).
    Its agent is started again at once, so the job re-forms with 3 nodes, not counting a restart, and
    every rank resumes from the last checkpoint."""
    job = launch(code=ELASTIC_TRAIN, nodes="2:3", backend="smddp", start="cold",
                 env={"STEPS": "30", "STEP_SLEEP": "0.1"})
    try:
        deadline = time.monotonic() + 90
        while "step 3 loss" not in job.logs(0):
            assert time.monotonic() < deadline and job.state in ("pending", "running"), (job.state, job.error)
            time.sleep(0.1)
        pids = job.status["pids"]
        agent = psutil.Process(pids[1]).ppid()
        os.kill(agent, signal.SIGKILL)
        assert job.wait(120) == "succeeded", job.error
    finally:
        job.stop()
    status = job.status
    formations = [e for e in status["membership"] if "hosts" in e]
    hosts = ["localhost/0", "localhost/1", "localhost/2"]
    assert [f["hosts"] for f in formations] == [hosts, hosts], status["membership"]
    assert formations[1]["lost"]["localhost/1"].startswith(f"its agent (pid {agent}) was killed by signal SIGKILL")
    assert status.get("restarts", 0) == 0 and job.result() == {"world": 3, "attempt": 1}
    log = job.logs(0)
    assert "node localhost/1 lost: its agent" in log and "the job goes on with 3 node(s)" in log, log
    resumed = [line for line in log.splitlines() if line.startswith("attempt 1 world 3 from step ")]
    assert resumed and int(resumed[0].split()[-1]) >= 3, resumed  # from its checkpoint, not from step 0
    deadline = time.monotonic() + 10
    while _alive(pids + [agent]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids + [agent]) == []


def test_a_frozen_agent_is_named_at_its_heartbeat_and_nothing_is_left(jobs_dir):
    """SIGSTOP, not SIGKILL: the agent holds its pipe and answers nothing. The job fails at the heartbeat
    (10 s) naming the agent's state, and the frozen agent and its ranks are ended, not left behind."""
    job = launch(code="import time\ntime.sleep(60)", nodes=2, backend="gloo", start="cold")
    pids = _ranks_started(job, 2)
    agent = psutil.Process(pids[1]).ppid()
    os.kill(agent, signal.SIGSTOP)
    try:
        assert job.wait(40) == "failed"
    finally:
        if _alive([agent]):
            os.kill(agent, signal.SIGCONT)
    assert job.error.startswith(f"host localhost/1 (node 1): its agent (pid {agent}) has not answered for 10 s: "
                                "stopped (SIGSTOP). Fix: --nodes 2:2"), job.error
    deadline = time.monotonic() + 15
    while _alive(pids + [agent]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids + [agent]) == []
