"""The Ray target on a real Ray cluster: head on h0, workers on h1..h3 (cluster-in-a-box), driver on h0.

Each job is started by a driver process on h0 that calls sdp_jupyter.launch(target="ray"), exactly as
a notebook would; the test watches the hosts from outside (processes, link counters).
"""
from __future__ import annotations

import os
import pickle
import signal
import sys
import time

import pytest

from helpers.heal_job import HEAL_JOB, check_remote_heal
from helpers.remote_jobs import RUN_FUNCTION, TRAIN, drive, drive_cells, drive_session, next_line, tell
from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch.kernel.agent_run import link, run as remote
from sdp_jupyter.testing.cluster import signal_all


def _drive(rh, jobs, **launch_args):
    args = {"target": "ray", "ray": {"address": rh.address}, "jobs_dir": str(jobs), "nodes": 4, **launch_args}
    return drive(rh.cluster, args, env=rh.env)


def _ranks_and_agents(cluster, host: int) -> list[int]:
    found = []
    for pid in cluster.pids(host):
        try:
            argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"sdp_jupyter.launch.rank.worker" in argv or b"sdp_jupyter.launch.host.agent" in argv:
            found.append(pid)
    return found


def _wait_clean(cluster, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = {h: _ranks_and_agents(cluster, h) for h in range(cluster.n)}
        left = {h: p for h, p in left.items() if p}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


# ---------------------------------------------------------------------------------- no cluster needed
def test_ray_options_need_the_ray_target():
    with pytest.raises(SpecError, match="--address: is an option of --target ray.*Fix: add --target ray"):
        JobSpec(code="x", ray={"address": "10.0.0.5:6379"})
    spec = JobSpec(code="x", target="ray", nodes=4, ray={"address": "10.0.0.5:6379"})
    assert "--target ray" in spec.to_magic_line() and "--address 10.0.0.5:6379" in spec.to_magic_line()


def test_a_targets_options_may_be_given_by_their_key():
    import sdp_jupyter

    # address= is ray={"address": ...}: with another target it is refused as a Ray option
    with pytest.raises(SpecError, match="--address: is an option of --target ray"):
        sdp_jupyter.launch(code="x", address="10.0.0.5:6379")


def test_without_ray_installed_the_error_gives_the_pip_command(monkeypatch):
    from sdp_jupyter.launch.targets.ray import launcher as ray_target

    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(SpecError, match=r"ray is not installed here. Fix: pip install ray "):
        ray_target.RayLauncher().start(JobSpec(code="x", target="ray"))


def test_an_unreachable_address_is_named_within_the_connect_deadline():
    from sdp_jupyter.launch.targets.ray import launcher as ray_target

    t0 = time.monotonic()
    with pytest.raises(SpecError, match=r"--address: cannot reach the Ray cluster at 127.0.0.1:1 within 10 s"):
        ray_target.connect("127.0.0.1:1")
    assert time.monotonic() - t0 < link.CONNECT_TIMEOUT + 2


def test_an_address_naming_another_cluster_than_the_joined_one_is_refused(monkeypatch):
    """A notebook that called ray.init() runs its jobs there: an --address naming another cluster is
    refused rather than ignored (no Ray cluster: a stand-in `ray` module that has joined one)."""
    import types

    from sdp_jupyter.launch.targets.ray import launcher as ray_target

    fake = types.ModuleType("ray")
    fake.is_initialized = lambda: True
    fake.get_runtime_context = lambda: types.SimpleNamespace(gcs_address="127.0.0.1:6379")
    monkeypatch.setitem(sys.modules, "ray", fake)
    with pytest.raises(SpecError, match=r"--address: 10\.9\.8\.7:6379: this process already joined the Ray "
                                        r"cluster at 127\.0\.0\.1:6379 \(ray\.init\).*Fix: drop --address.*"
                                        r"ray\.shutdown\(\) first"):
        ray_target.connect("10.9.8.7:6379", given="10.9.8.7:6379")
    with pytest.raises(SpecError, match="already joined"):  # this machine, another port: another cluster
        ray_target.connect("localhost:6380", given="localhost:6380")
    # the joined cluster, by any of its names (a ray:// client port on the same host too), or no --address
    for given in ("127.0.0.1:6379", "localhost:6379", "ray://localhost:10001", "auto", None):
        assert ray_target.connect("127.0.0.1:6379", given=given) is fake
    fake.get_runtime_context = lambda: (_ for _ in ()).throw(RuntimeError("cannot say"))
    assert ray_target.connect("10.9.8.7:6379", given="10.9.8.7:6379") is fake  # nothing to compare


def test_a_poll_answered_late_is_waited_for_again_so_the_hello_it_carries_is_not_lost(monkeypatch):
    """CI failed Ray jobs with "connected, but the agent did not start within 60 s (no output)": the
    first recv call, queued while Ray started the actor's worker, timed out in ray.get and was asked
    anew; the actor still answered the first one (with the agent's hello), to nobody."""
    import json
    import queue
    import types

    from sdp_jupyter.launch.targets.ray import launcher as ray_target

    class Timeout(Exception):
        pass

    asked, waits = [], {}

    class Recv:
        def remote(self, wait):
            asked.append(len(asked))
            return asked[-1]

    def get(ref, timeout=None):  # the actor answers its calls in order: call 0 carries the hello
        waits[ref] = waits.get(ref, 0) + 1
        if ref == 0 and waits[ref] == 1:
            raise Timeout()  # still queued while the worker starts
        if ref == 0:
            return [json.dumps({"type": "hello"}).encode()], None, []
        return [json.dumps({"type": "ping"}).encode()], 0, []  # then the agent ends: the poll stops

    fake = types.ModuleType("ray")
    fake.get, fake.exceptions = get, types.SimpleNamespace(GetTimeoutError=Timeout)
    monkeypatch.setitem(sys.modules, "ray", fake)
    inbox = queue.Queue()
    link = ray_target.RayLink(0, "h0", types.SimpleNamespace(recv=Recv()), inbox)
    node, first = inbox.get(timeout=5)
    assert first["type"] == "hello" and link.connected.is_set() and waits[0] == 2
    assert [m["type"] for _, m in (inbox.get(timeout=5), inbox.get(timeout=5))] == ["ping", "eof"]


# ---------------------------------------------------------------------------------- a real cluster
@pytest.mark.slow
def test_four_ray_nodes_train_like_the_local_run(ray_hosts, hosts, tmp_path, jobs_dir):
    import torch

    import sdp_jupyter

    before = {i: hosts.bytes(i)["tx"] for i in range(4)}
    d = _drive(ray_hosts, tmp_path / "remote", name="ray-four", ranks_output="all")
    out = next_line(d, timeout=180)
    assert out.get("state") == "succeeded", out
    moved = {i: hosts.bytes(i)["tx"] - before[i] for i in range(4)}
    remote_result = pickle.load(open(os.path.join(out["dir"], "result.pkl"), "rb"))
    # STRICT_SPREAD: four distinct Ray nodes, each rank at its own node's address
    assert sorted(n for n, _ in remote_result["hosts"]) == ["h0", "h1", "h2", "h3"], remote_result["hosts"]
    assert sorted(a for _, a in remote_result["hosts"]) == sorted(hosts.addresses)
    assert sorted(out["status"]["host_names"]) == ["h0", "h1", "h2", "h3"]
    assert all(b > 1_000_000 for b in moved.values()), moved  # gradients crossed every link
    assert all("step 5" in open(os.path.join(out["dir"], "logs", f"rank-{r}.log")).read() for r in range(4))
    local = sdp_jupyter.launch(code=TRAIN, nodes=4, name="local-four")
    assert local.wait(timeout=180) == "succeeded", local.error
    assert torch.allclose(local.result()["params"], remote_result["params"], rtol=1e-5, atol=1e-6)
    assert _wait_clean(hosts, 10) == {}
    print(f"\n[ray] test cluster memory (4 nodes, RSS of Ray's processes): {ray_hosts.memory_mb():.0f} MB")


@pytest.mark.slow
def test_run_a_notebook_function_on_ray_nodes(ray_hosts, hosts, tmp_path):
    args = {"target": "ray", "ray": {"address": ray_hosts.address}, "jobs_dir": str(tmp_path), "nodes": 2,
            "backend": "gloo"}
    out = next_line(drive(ray_hosts.cluster, args, env=ray_hosts.env, driver=RUN_FUNCTION), timeout=180)
    assert [v[0] for v in out["values"]] == [0, 1] and all(v[2:] == [2, 60] for v in out["values"]), out
    assert len({v[1] for v in out["values"]}) == 2, out  # two Ray nodes (STRICT_SPREAD)
    assert _wait_clean(hosts, 10) == {}


@pytest.mark.slow
def test_too_many_nodes_are_refused_listing_the_cluster(ray_hosts, tmp_path):
    d = _drive(ray_hosts, tmp_path, nodes=5)
    err = next_line(d)["spec_error"]
    assert err.startswith("--nodes: 5 node(s) with 1 CPU each asked, and the Ray cluster at")
    assert "has 4 such node(s) of 4" in err and "10.213.0.4 (1 CPU, 0 GPU)" in err and "Fix: --nodes 4" in err
    assert _wait_clean(ray_hosts.cluster, 5) == {}


@pytest.mark.slow
def test_stop_leaves_nothing_on_any_node(ray_hosts, tmp_path):
    d = _drive(ray_hosts, tmp_path, env={"STEPS": "100000", "STEP_SLEEP": "0.2"})
    assert "running" in next_line(d, timeout=180)
    assert all(_ranks_and_agents(ray_hosts.cluster, h) for h in range(4))
    tell(d, "stop")
    assert next_line(d)["stopped_in"] < 15
    assert next_line(d)["state"] == "stopped"
    assert _wait_clean(ray_hosts.cluster, 5) == {}


@pytest.mark.slow
def test_a_node_without_sdp_jupyter_is_named_and_nothing_starts(ray_hosts, tmp_path):
    """h3's Ray node runs with a shadow `sdp_jupyter` first on its path that cannot be imported, as on
    a node where the package is not installed."""
    shadow = tmp_path / "shadow" / "sdp_jupyter"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'sdp_jupyter'\", "
                                        "name='sdp_jupyter')\n")
    ray_hosts.restart_node(3, env={"PYTHONPATH": str(shadow.parent)})
    try:
        d = _drive(ray_hosts, tmp_path)
        err = next_line(d, timeout=120)["spec_error"]
        assert err.startswith("--nodes: 1 of 4 host(s) cannot run the job; nothing was started")
        assert "10.213.0.4: sdp_jupyter is not importable by the Ray workers there. Fix: install sdp_jupyter " in err
        assert _wait_clean(ray_hosts.cluster, 10) == {}
    finally:
        ray_hosts.restart_node(3)


@pytest.mark.slow
def test_a_lost_node_is_named_within_ten_seconds(ray_hosts, tmp_path):
    c = ray_hosts.cluster
    d = _drive(ray_hosts, tmp_path, env={"STEPS": "100000", "STEP_SLEEP": "0.2"})
    assert "running" in next_line(d, timeout=180)
    tell(d, "wait")
    try:
        # the Ray node on h2 loses power, as far as its processes are concerned: Ray's and the job's
        victims = ray_hosts.ray_pids(2) + _ranks_and_agents(c, 2)
        killed_at = time.time()
        signal_all(victims, signal.SIGKILL)
        out = next_line(d, timeout=60)
        assert out.get("state") == "failed"
        assert "(node " in out["error"] and "10.213.0.3" in out["error"], out["error"]
        assert out["t"] - killed_at < remote.HEARTBEAT_TIMEOUT + 1, out["t"] - killed_at
        assert _wait_clean(c, 10) == {}
    finally:
        ray_hosts.restart_node(2)


@pytest.mark.slow
def test_a_dead_rank_on_a_ray_node_is_replaced_there_while_the_others_keep_their_processes(ray_hosts, tmp_path):
    """--heal through the agents' Ray actors: rank 2 SIGKILLs itself in step 20, its node's agent starts it
    again, the other three keep their processes (tests/launch/test_heal.py has the local and SSH cases)."""
    d = _drive(ray_hosts, tmp_path, code=HEAL_JOB, heal=True, max_restarts=2, backend="smddp", name="ray-heal",
               ranks_output="all", env={"DIES": "2", "SIG": "SIGKILL"})
    check_remote_heal(next_line(d, timeout=240), 4, dies=2)
    assert _wait_clean(ray_hosts.cluster, 10) == {}


@pytest.mark.slow
def test_an_elastic_job_goes_on_without_a_lost_ray_node_and_takes_the_spare(ray_hosts, tmp_path):
    """--nodes 2:3 on 4 Ray nodes: one node is a spare. A used node loses power: the job goes on with two,
    and once Ray places the lost node's bundle on the spare, the job re-forms with three again."""
    import json

    from helpers.monitor_jobs import wait_for
    from helpers.remote_jobs import ELASTIC_TRAIN

    c = ray_hosts.cluster
    jobs = tmp_path / "jobs"
    d = _drive(ray_hosts, jobs, code=ELASTIC_TRAIN, name="ray-el", nodes="2:3",
               env={"STEPS": "100000", "STEP_SLEEP": "0.2"})
    assert "running" in next_line(d, timeout=180)

    def formations():
        try:
            status = json.loads((jobs / "ray-el" / "status.json").read_text())
        except (OSError, ValueError):
            return []
        return [e for e in status.get("membership", []) if "hosts" in e]

    first = formations()[0]["hosts"]
    victim = next(h for h in range(1, c.n) if c.addresses[h] in first)
    spare = next(a for a in c.addresses if a not in first)
    try:
        signal_all(ray_hosts.ray_pids(victim) + _ranks_and_agents(c, victim), signal.SIGKILL)
        t_kill = time.monotonic()
        two = wait_for(lambda: [f for f in formations() if len(f["hosts"]) == 2], timeout=60, every=0.3,
                       what="a 2-node formation")
        went_on = time.monotonic() - t_kill
        assert c.addresses[victim] in two[0]["lost"] and c.addresses[victim] not in two[0]["hosts"], two
        three = wait_for(lambda: [f for f in formations()[2:] if len(f["hosts"]) == 3], timeout=150, every=0.5,
                         what="the spare joining")
        assert spare in three[0]["hosts"] and c.addresses[victim] not in three[0]["hosts"], three
        wait_for(lambda: "world 3 from step" in "".join(
            (jobs / "ray-el" / "logs" / "rank-0.log").read_text().splitlines()[-40:]), timeout=60, what="training on 3")
        tell(d, "stop")
        assert next_line(d, timeout=60).get("stopped_in") is not None
        out = next_line(d, timeout=60)
        assert out["state"] == "stopped" and out["status"].get("restarts", 0) == 0, out
        print(f"Ray node lost to a 2-node formation: {went_on:.1f} s")
        assert _wait_clean(c, 15) == {}
    finally:
        ray_hosts.restart_node(victim)


def _pools(cluster) -> dict:
    """Per host: processes running the warm pool server, or forked from it (a warm rank)."""
    found = {}
    for h in range(cluster.n):
        found[h] = []
        for pid in cluster.pids(h):
            try:
                argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
            except OSError:
                continue
            if b"sdp_jupyter.launch.host.warm" in argv:
                found[h].append(pid)
    return found


def _wait_no_pools(cluster, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        left = {h: p for h, p in _pools(cluster).items() if p}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.slow
def test_warm_starts_on_ray_nodes_match_cold_and_end_with_the_notebook(ray_hosts, tmp_path):
    c = ray_hosts.cluster
    args = {"target": "ray", "ray": {"address": ray_hosts.address}, "jobs_dir": str(tmp_path / "jobs"), "nodes": 4}
    # --warm starts a pool on each Ray node (an actor pinned there holds it); the next job (no flag)
    # finds them and starts warm; --cold does not use them; all three train to the same bits
    d = drive_session(c, args, [["w1", "warm", {}], ["w2", "auto", {}], ["c3", "cold", {}]], env=ray_hosts.env)
    runs = [next_line(d, timeout=240) for _ in range(3)]
    for run in runs:
        assert run["state"] == "succeeded", run
    assert [r["status"].get("start") for r in runs] == ["warm", "warm", "cold"], [r["status"].get("start_reason") for r in runs]
    assert "warm start" in runs[1]["summary"]
    assert runs[0]["params"] == runs[1]["params"] == runs[2]["params"]
    assert all(len(p) == 1 for p in _pools(c).values()), _pools(c)  # each node: its pool server, no rank
    assert _wait_clean(c, 5) == {}
    tell(d, "exit")  # the notebook ends: its pool actors and their servers end with it
    d.wait(timeout=60)
    assert _wait_no_pools(c, 30) == {}

    # killed outright while a warm job runs: Ray ends the driver's actors (the agents' and the pools'),
    # and nothing of the job or the pools is left on any node
    d = drive_session(c, args, [["w4", "warm", {"STEPS": "100000", "STEP_SLEEP": "0.2"}]], env=ray_hosts.env)
    assert next_line(d, timeout=240)["status"]["start"] == "warm"
    d.send_signal(signal.SIGKILL)
    d.wait()
    assert _wait_no_pools(c, remote.HEARTBEAT_TIMEOUT + 20) == {}
    assert _wait_clean(c, remote.HEARTBEAT_TIMEOUT + 5) == {}


@pytest.mark.slow
def test_a_session_on_ray_nodes_keeps_its_ranks_between_cells(ray_hosts, tmp_path):
    """The session's cells and answers ride the agents' frames through the Ray actors."""
    args = {"target": "ray", "ray": {"address": ray_hosts.address}, "jobs_dir": str(tmp_path / "jobs"), "nodes": 4}
    drive_cells(ray_hosts.cluster, args, ["h0", "h1", "h2", "h3"], env=ray_hosts.env)
    assert _wait_clean(ray_hosts.cluster, 10) == {}
