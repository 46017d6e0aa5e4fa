"""The local target runs every node through the node agent (launch/host/agent.py), as the SSH, Ray and
Slurm targets do: a local job's ranks are children of one agent per node, each agent a child of this
process; an agent that dies takes its node's ranks with it and the job names it; none is left after."""
from __future__ import annotations

import os
import signal
import time

import psutil

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
    assert job.error.startswith(f"host localhost (node 1): its agent (pid {agent}) was killed by signal SIGKILL, "
                                "and its ranks with it"), job.error
    deadline = time.monotonic() + 10
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _alive(pids) == []  # rank 1 by its parent-death signal, rank 0 stopped by its agent
