"""Elastic jobs (--nodes MIN:MAX, launch/kernel/elastic.py) on the SSH test hosts h1..h3, the notebook on h0.

A node is lost as it happens in real use: its agent and ranks SIGKILLed mid-training (the host itself is
fine, so it is back in the next formation), or its link cut (it is left out; once healed it rejoins:
notebooks/11_elastic.ipynb, run by tests/notebook/test_notebooks.py, on the same hosts). The job must go
on, resume from its checkpoint and succeed, with every change on its status's timeline.
"""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from helpers.remote_jobs import ELASTIC_TRAIN, drive, next_line, tell
from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.testing.cluster import signal_all


def _drive(hosts, jobs, name, **launch_args):
    args = {"target": "ssh", "ssh": {"hosts": hosts.hosts, "config": str(hosts.config)}, "jobs_dir": str(jobs),
            "code": ELASTIC_TRAIN, "name": name, "nodes": "2:3", **launch_args}
    return drive(hosts.cluster, args)


def _logs(out) -> str:
    folder = os.path.join(out["dir"], "logs")
    return "".join(open(os.path.join(folder, f)).read() for f in sorted(os.listdir(folder)))


# ---------------------------------------------------------------------------------- no hosts needed
def test_min_max_nodes_parse_and_are_refused_where_the_node_count_is_fixed():
    spec = JobSpec(code="x", nodes="2:3", target="ssh", ssh={"hosts": "a,b,c"})
    assert (spec.min_nodes, spec.nodes, spec.elastic) == (2, 3, True)
    assert "--nodes 2:3" in spec.to_magic_line()
    assert JobSpec.from_dict(spec.to_dict()) == spec
    assert not JobSpec(code="x", nodes=3).elastic
    with pytest.raises(SpecError, match="MIN is more than MAX. Fix: --nodes 2:3"):
        JobSpec(code="x", nodes="3:2", target="ssh")
    assert JobSpec(code="x", nodes="2:4").elastic  # the local target: a killed node agent is started again
    with pytest.raises(SpecError, match="instance count is fixed"):
        JobSpec(code="x", nodes="1:2", target="sagemaker")
    with pytest.raises(SpecError, match="--elastic-wait"):
        JobSpec(code="x", nodes="1:2", target="ssh", elastic_wait="soon")
    with pytest.raises(SpecError, match="SDP_ELASTIC is set by the launcher"):
        JobSpec(code="x", env={"SDP_ELASTIC": "1"})


class _Run:
    """A remote run as elastic.Membership sees it: three links, and attempts that end as scripted."""

    def __init__(self, outcomes, max_restarts=1):
        import queue
        import threading

        self.spec = JobSpec(code="x", nodes="2:3", target="ssh", ssh={"hosts": "a,b,c"}, max_restarts=max_restarts,
                            procs_per_node=1)
        self.hosts = ["a", "b", "c"]
        self.conns = [type("Link", (), {"node": n, "host": h, "last_heard": time.monotonic(), "inbox": None,
                                        "close": lambda self, wait=0: None})() for n, h in enumerate(self.hosts)]
        self.inbox, self._stop, self.stop_reason = queue.Queue(), threading.Event(), None
        self.members, self._lost, self.preflight_missing, self.membership = None, {}, {}, None
        self.heartbeat_timeout, self.hello_timeout = 10.0, 1.0
        self.status, self.outcomes, self.formed = {}, list(outcomes), []
        self.job = type("Job", (), {"update_status": lambda _, **kw: self.status.update(kw), "dir": Path("job")})()
        self.markers = []  # what the dashboard would read
        self.ended = None

    @property
    def stopping(self):
        return self._stop.is_set()

    def write_metrics(self, name, text):
        self.markers.append(json.loads(text))

    def lost(self):
        return dict(self._lost)

    def attempt(self, attempt):
        self.formed.append([self.hosts[n] for n in self.members])
        state, error, left = self.outcomes.pop(0)
        self._lost = {n: (why, time.time()) for n, why in left.items()}
        return state, error, []

    def reopen(self, node, inbox):
        return None  # a lost host stays lost

    def eof_reason(self, node, message):
        return "gone"

    def rejoined(self, node, link):
        pass

    def elastic_ended(self, state):
        self.ended = state


def test_a_failure_counts_a_restart_and_a_lost_node_does_not(monkeypatch):
    from sdp_jupyter.launch.kernel import elastic

    monkeypatch.setattr(elastic, "REFORM_GRACE", 0.1)
    said = []
    run = _Run([("failed", "rank 1 exited with code 1", {}),            # a failure: restart 1 of 1
                ("failed", "host c (node 2): gone", {2: "its link ended"}),  # a lost node: no restart spent
                ("succeeded", None, {})])
    assert elastic.Membership(run, said.append).attempts() == ("succeeded", None, [])
    assert run.formed == [["a", "b", "c"], ["a", "b", "c"], ["a", "b"]]
    assert run.status["restarts"] == 1 and run.ended == "succeeded"
    timeline = run.status["membership"]
    assert [e["why"] for e in timeline] == ["started", "restart 1 of 1", "host c (node 2): gone"]
    assert timeline[2]["lost"] == {"c": "its link ended"} and timeline[2]["world_size"] == 2
    assert any("node c lost: its link ended; the job goes on with 2 node(s): a, b" in s for s in said), said
    assert [m["label"] for m in run.markers] == ["restart 1 of 1: 3 nodes", "c lost: 2 nodes"]
    # a second failure with no restart left ends the job; a lost node below MIN waits, then names it
    run = _Run([("failed", "rank 0 exited with code 1", {}), ("failed", "rank 0 exited with code 1", {})])
    assert elastic.Membership(run, said.append).attempts()[0:2] == ("failed", "rank 0 exited with code 1")
    run = _Run([("failed", "host b: gone", {1: "cut", 2: "cut"})])
    run.spec = run.spec.replace(elastic_wait=0.3)
    state, error, _ = elastic.Membership(run, said.append).attempts()
    assert state == "failed" and "fewer than 2 node(s)" in error and "b (since " in error and "c (since " in error


def test_a_spare_takes_the_place_of_a_lost_node_and_a_survivor_is_node_0(monkeypatch):
    from sdp_jupyter.launch.kernel import elastic

    monkeypatch.setattr(elastic, "REFORM_GRACE", 0.1)
    run = _Run([("failed", "host a: gone", {0: "dead"}), ("succeeded", None, {})])
    run.spec = run.spec.replace(nodes=2)  # a, b in the job; c a spare
    assert elastic.Membership(run, lambda s: None).attempts()[0] == "succeeded"
    assert run.formed == [["a", "b"], ["b", "c"]]  # b (held the checkpoint) is node 0 now; the spare joins


# ---------------------------------------------------------------------------------- real hosts
def _agent_and_ranks(ssh_hosts, host: int) -> list[int]:
    return ssh_hosts.processes(host) + ssh_hosts.processes(host, "sdp_jupyter.launch.host.agent")


@pytest.mark.slow
def test_a_killed_node_is_back_in_the_next_formation_and_the_job_resumes(ssh_hosts, hosts, tmp_path):
    jobs = tmp_path / "jobs"
    d = _drive(ssh_hosts, jobs, "el-kill", env={"STEPS": "40", "STEP_SLEEP": "0.15"})
    assert "running" in next_line(d)
    killed = _agent_and_ranks(ssh_hosts, 3)
    assert killed
    signal_all(killed, signal.SIGKILL)  # the host stays up (sshd answers): its agent and ranks die at once
    t_kill = time.time()
    tell(d, "wait")
    out = next_line(d, timeout=150)
    assert out["state"] == "succeeded", out["error"]
    status = out["status"]
    formations = [e for e in status["membership"] if "hosts" in e]
    assert [f["hosts"] for f in formations] == [["h1", "h2", "h3"], ["h1", "h2", "h3"]], status["membership"]
    assert "h3" in formations[1]["lost"] and formations[1]["t"] - t_kill < 40, formations
    assert status.get("restarts", 0) == 0  # a lost node is a membership change, not a failure
    logs = _logs(out)
    assert "node h3 lost" in logs and "the job goes on with 3 node(s): h1, h2, h3" in logs
    resumed = [line for line in logs.splitlines() if line.startswith("attempt 1 world 3 from step ")]
    assert resumed and int(resumed[0].split()[-1]) > 2, resumed  # from its checkpoint, not from step 0
    assert ssh_hosts.wait_clean(10) == {}


@pytest.mark.slow
def test_a_frozen_node_is_lost_at_its_heartbeat_and_a_new_agent_takes_its_place(ssh_hosts, hosts, tmp_path):
    jobs = tmp_path / "jobs"
    d = _drive(ssh_hosts, jobs, "el-stop", env={"STEPS": "60", "STEP_SLEEP": "0.15"})
    assert "running" in next_line(d)
    frozen = _agent_and_ranks(ssh_hosts, 3)
    # SIGSTOP: alive, silent, holding its sockets (a hung host, a long GC pause, a VM paused)
    signal_all(frozen, signal.SIGSTOP)
    tell(d, "wait")
    try:
        out = next_line(d, timeout=150)
    finally:
        signal_all(frozen, signal.SIGCONT)
    assert out["state"] == "succeeded", out["error"]
    formations = [e for e in out["status"]["membership"] if "hosts" in e]
    assert [f["hosts"] for f in formations] == [["h1", "h2", "h3"], ["h1", "h2", "h3"]], formations
    assert formations[1]["lost"] == {"h3": "has not answered for 10 s: its link or the host is down"}
    # once thawed, the old agent finds its channel closed and stops its ranks: nothing is left
    assert ssh_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_when_node_0_is_lost_the_survivors_are_renumbered_and_the_job_ends(ssh_hosts, hosts, tmp_path):
    """h1 (node 0) loses its link for good: h2 and h3 go on as nodes 0 and 1 under the agents they had.
    Each agent must forget the rank it ran before (found by benchmarks/elastic_churn.py: h2's agent kept
    waiting for its old rank 1, never said its attempt was done, and was taken for lost 13 s later)."""
    jobs = tmp_path / "jobs"
    d = _drive(ssh_hosts, jobs, "el-node0", env={"STEPS": "40", "STEP_SLEEP": "0.15"})  # held while h1 is lost
    assert "running" in next_line(d)
    hosts.cut(1)
    tell(d, "wait")
    try:
        out = next_line(d, timeout=150)
    finally:
        hosts.heal(1)
    assert out["state"] == "succeeded", out["error"]
    formations = [e for e in out["status"]["membership"] if "hosts" in e]
    assert [f["hosts"] for f in formations] == [["h1", "h2", "h3"], ["h2", "h3"]], out["status"]["membership"]
    assert list(formations[1]["lost"]) == ["h1"], formations[1]
    assert out["status"].get("restarts", 0) == 0
    assert "attempt 1 world 2 from step " in _logs(out)
    assert ssh_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_below_min_the_job_waits_then_names_each_missing_host_and_why(ssh_hosts, hosts, tmp_path):
    jobs = tmp_path / "jobs"
    # a host that fails the check before the start is left out while MIN others pass it
    d = _drive(ssh_hosts, jobs, "el-min", elastic_wait=4, env={"STEPS": "400", "STEP_SLEEP": "0.15"},
               ssh={"hosts": ["h1", "h2", "nosuchhost"], "config": str(ssh_hosts.config)})
    assert "running" in next_line(d)
    hosts.cut(2)  # h2 goes silent: one node left of MIN 2
    tell(d, "wait")
    out = next_line(d, timeout=120)
    assert out["state"] == "failed", out
    err = out["error"]
    assert err.startswith("fewer than 2 node(s) (--nodes 2:3) were usable for 4 s (--elastic-wait); missing: "), err
    assert "h2 (since " in err and "nosuchhost (since " in err, err
    assert "ssh cannot reach it" in err or "not reachable" in err, err  # why nosuchhost was left out
    formations = [f["hosts"] for f in out["status"]["membership"] if "hosts" in f]
    assert formations == [["h1", "h2"]], out["status"]["membership"]
    logs = _logs(out)
    assert "1 node(s) usable, the job needs 2: waiting up to 4 s (--elastic-wait) for hosts to return" in logs
    assert ssh_hosts.wait_clean(20) == {}


def test_a_host_whose_client_cannot_start_is_tried_again(monkeypatch):
    """reopen() raising (ssh or a local agent could not start: out of processes, say) is not the end of
    that host: it is tried again after RETRY_EVERY, as a host that did not answer is."""
    from sdp_jupyter.launch.kernel import elastic

    monkeypatch.setattr(elastic, "RETRY_EVERY", 0.05)
    calls = []

    class Failing(_Run):
        def reopen(self, node, inbox):
            calls.append(node)
            if len(calls) == 1:
                raise OSError("no room for another process")
            return None  # then lost for good: the retry ends

    run = Failing([])
    membership = elastic.Membership(run, lambda s: None)
    run.membership = membership
    membership.lose(2, "its agent was killed")
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert calls == [2, 2]


def test_membership_reaches_the_run_only_through_its_door():
    """elastic.Membership uses of its run only what ElasticRun names (no private attribute), and the run
    every target shares has all of it: the door is the whole interface, both ways."""
    import ast
    import inspect
    import typing

    from sdp_jupyter.launch.kernel import elastic
    from sdp_jupyter.launch.kernel.agent_run.run import AgentRun

    door = set(typing.get_type_hints(elastic.ElasticRun, include_extras=False)) | {
        n for n, v in vars(elastic.ElasticRun).items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    used = set()
    for node in ast.walk(ast.parse(inspect.getsource(elastic))):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "run") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "run"
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                used.add(node.attr)
    assert used and used <= door, f"Membership uses what its door does not name: {sorted(used - door)}"
    missing = [n for n in door if not hasattr(AgentRun, n) and n not in AgentRun.__init__.__code__.co_names]
    assert not missing, f"the run lacks what the door names: {missing}"
    assert "lost" in used and "attempt" in used  # the check sees real uses
