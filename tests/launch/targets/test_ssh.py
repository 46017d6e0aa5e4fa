"""The SSH target on real hosts: an sshd on each of h1..h3 (cluster-in-a-box), the notebook on h0.

Every job here is started by a driver process on h0 that calls sdp_jupyter.launch(target="ssh"),
exactly as a notebook would; the test watches the hosts from outside (processes, link counters).
"""
from __future__ import annotations

import os
import pickle
import signal
import time

import pytest

from helpers.remote_jobs import ELASTIC_TRAIN, REPO, TRAIN, drive, drive_session, next_line, tell
from sdp_jupyter.launch import JobSpec, SpecError
from sdp_jupyter.launch import channel
from sdp_jupyter.launch.kernel.agent_run import link, run as remote
from sdp_jupyter.launch.targets.ssh import launcher as ssh_target

def _drive(hosts, jobs, **launch_args):
    """The driver on h0, launching on the SSH hosts with the test's ssh_config."""
    args = {"target": "ssh", "ssh": {"hosts": hosts.hosts, "config": str(hosts.config)}, "jobs_dir": str(jobs),
            **launch_args}
    return drive(hosts.cluster, args)


# ---------------------------------------------------------------------------------- no hosts needed
def test_hostfile_is_deepspeeds_format(tmp_path):
    f = tmp_path / "hosts.txt"
    f.write_text("# the team's boxes\ngpu1 slots=8\n\nroot@gpu2 slots=8  # the new one\n")
    spec = JobSpec(code="x", target="ssh", ssh={"hostfile": str(f)})
    assert ssh_target.hosts_of(spec) == (["gpu1", "root@gpu2"], 8)
    f.write_text("gpu1 slots=8\ngpu2 slots=4\n")
    with pytest.raises(SpecError, match="different slots.*--procs-per-node"):
        ssh_target.hosts_of(spec)
    f.write_text("gpu1 gpus=8\n")
    with pytest.raises(SpecError, match="line 1.*slots=N"):
        ssh_target.hosts_of(spec)


@pytest.mark.parametrize("hosts, fragment", [
    (["-oProxyCommand=touch /tmp/x"], "not a host name"),
    (["gpu1;reboot"], "not a host name"),
    ([], "needs the hosts"),
])
def test_bad_hosts_are_refused_before_ssh_runs(hosts, fragment):
    with pytest.raises(SpecError, match=fragment) as info:
        ssh_target.SSHLauncher().resolve(JobSpec(code="x", target="ssh", ssh={"hosts": hosts}))
    assert info.value.option == "--hosts"


def test_ssh_options_need_the_ssh_target_and_round_trip_through_the_magic_line():
    with pytest.raises(SpecError, match="--hosts: is an option of --target ssh.*Fix: add --target ssh"):
        JobSpec(code="x", ssh={"hosts": ["a"]})
    spec = JobSpec(code="x", target="ssh", nodes=2, ssh={"hosts": ["a", "b"], "config": "/etc/c", "python": "/p y"})
    line = spec.to_magic_line()
    assert "--hosts a,b" in line and "--ssh-config /etc/c" in line and "--python '/p y'" in line
    from sdp_jupyter.magics import SdpMagics, parse_line

    args = parse_line(SdpMagics.sdp_train, line[len("%%sdp_train "):])
    assert JobSpec.from_options(vars(args), code="x").ssh == spec.ssh


def test_more_nodes_than_hosts_is_refused_and_nodes_default_to_the_hosts():
    launcher = ssh_target.SSHLauncher()
    spec, hosts, _ = launcher.resolve(JobSpec(code="x", target="ssh", ssh={"hosts": ["a", "b", "c"]}))
    assert spec.nodes == 3 and hosts == ["a", "b", "c"]
    spec, hosts, _ = launcher.resolve(JobSpec(code="x", target="ssh", nodes=2, ssh={"hosts": ["a", "b", "c"]}))
    assert spec.nodes == 2 and hosts == ["a", "b"]
    spec, hosts, _ = launcher.resolve(JobSpec(code="x", target="ssh", nodes=1, ssh={"hosts": ["a", "b", "c"]}))
    assert spec.nodes == 1 and hosts == ["a"]  # --nodes 1 is one host, not "not given"
    from sdp_jupyter.magics import SdpMagics, parse_line

    args = parse_line(SdpMagics.sdp_train, "--target ssh --hosts a,b,c --nodes 1")
    assert JobSpec.from_options(vars(args), code="x").nodes == 1
    assert JobSpec.from_options(vars(parse_line(SdpMagics.sdp_train, "--target ssh --hosts a,b")), code="x").nodes is None
    with pytest.raises(SpecError, match="4 nodes but 3 host"):
        launcher.resolve(JobSpec(code="x", target="ssh", nodes=4, ssh={"hosts": ["a", "b", "c"]}))


def test_agent_frames_round_trip_and_refuse_garbage():
    import io
    import struct

    frame = channel.encode({"type": "out", "rank": 3, "text": "é\n"})
    assert channel.decode(io.BytesIO(frame)) == {"type": "out", "rank": 3, "text": "é\n"}
    with pytest.raises(ValueError, match="over the"):
        channel.decode(io.BytesIO(struct.pack(">I", channel.MAX_FRAME + 1)))
    with pytest.raises(ValueError, match="not an object with a type"):
        channel.decode(io.BytesIO(struct.pack(">I", 2) + b"[]"))
    with pytest.raises(channel.ChannelClosed):
        channel.decode(io.BytesIO(frame[:-1]))


def test_an_agent_whose_session_store_starts_slowly_keeps_reading_its_launchers_frames(tmp_path):
    """Node 0's agent starts a session's store (launch/host/session_store.py). It once waited for it
    inside its frame loop, read no ping meanwhile, and gave the launcher up (exit 3) when the store took
    longer than the heartbeat timeout: in the whole suite, the Ray session's node 0 did."""
    import subprocess
    import sys

    # a store that says "ready" after 4 s, with the agent's heartbeat timeout at 2 s
    code = ("import subprocess, sys\n"
            "from sdp_jupyter.launch.host import session_store\n"
            "def slow(job_dir, addr, port):\n"
            "    p = subprocess.Popen(['sh', '-c', 'sleep 4; echo ready; cat'], stdin=subprocess.PIPE, "
            "stdout=subprocess.PIPE)\n"
            "    p.where = 'a test store'\n"
            "    return p\n"
            "session_store.start = slow\n"
            "import sdp_jupyter.launch.host.agent as a\n"
            "sys.exit(a.main())\n")
    env = dict(os.environ, SDP_AGENT_DIR=str(tmp_path))
    agent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
    try:
        assert channel.decode(agent.stdout)["type"] == "hello"
        spec = JobSpec(code="x", name="slow-store", nodes=1, procs_per_node=1, env={"SDP_SESSION_STORE": "1"})
        agent.stdin.write(channel.encode({
            "type": "start", "spec": spec.to_dict(), "node": 0, "secret": "s" * 64, "master_addr": "127.0.0.1",
            "master_port": 1, "attempt": 0, "script": channel.b64(b"import time\ntime.sleep(30)\n"),
            "push": None, "heartbeat_timeout": 2.0, "session": True}))
        agent.stdin.flush()
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:  # pings every 0.5 s, as the launcher's keep-alive does
            agent.stdin.write(channel.encode({"type": "ping"}))
            agent.stdin.flush()
            time.sleep(0.5)
            assert agent.poll() is None, f"the agent gave up its launcher (exit {agent.returncode})"
        agent.stdin.write(channel.encode({"type": "bye"}))
        agent.stdin.flush()
        assert agent.wait(timeout=20) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()


class _LocalAgentLink(ssh_target.SSHLink):
    """An SSH link whose 'ssh' is a local agent started `delay` seconds late, hearing nothing for 2 s
    enough to stop (the real agent gives up after 15 s)."""

    def __init__(self, node, inbox, delay):
        import subprocess
        import sys
        import threading

        remote.Link.__init__(self, node, f"local{node}", inbox)
        self._send_lock = threading.Lock()
        code = (f"import time, sys; time.sleep({delay}); import sdp_jupyter.launch.host.agent as a; "
                "a.HEARTBEAT_TIMEOUT = 2.0; sys.exit(a.main())")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE)
        self.connected.set()
        threading.Thread(target=self._read, daemon=True).start()
        self._err_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._err_thread.start()


def test_agents_that_said_hello_are_kept_alive_while_a_slow_host_starts():
    # CI once failed a 4-node Ray job: 3 agents said hello, heard nothing while the 4th started (over
    # 15 s on a loaded machine) and stopped (exit 3); the launcher pings every agent from the start
    spec = JobSpec(code="x", target="ssh", nodes=3, ssh={"hosts": ["a", "b", "c"]})

    class Run(ssh_target.SSHRun):
        def open_links(self):
            return [_LocalAgentLink(n, self.inbox, delay) for n, delay in enumerate([0, 0, 6])]

    run = Run(spec, ["a", "b", "c"], ssh_target.SSHLauncher())
    try:
        run.preflight()
        assert all(c.hello for c in run.conns) and all(c.proc.poll() is None for c in run.conns)
    finally:
        run.close_all()
    assert [c.proc.wait(timeout=10) for c in run.conns] == [0, 0, 0]


def test_each_link_kind_has_its_own_time_to_connect_and_then_the_agent_its_own_time_to_say_hello(monkeypatch):
    # a Ray link is 'connected' once Ray has started a worker for its actor, which on a busy node
    # takes longer than an ssh connection: it has the hello's time for that. The agent's hello is
    # then timed from the moment its link connected (CI failed a Ray job whose actors took most of
    # one shared minute to start: "connected, but the agent did not start within 60 s")
    import threading

    from sdp_jupyter.launch import channel
    from sdp_jupyter.launch.targets.ray import launcher as ray_target

    assert ray_target.RayLink.connect_timeout == remote.HELLO_TIMEOUT > remote.Link.connect_timeout
    monkeypatch.setattr(remote, "HELLO_TIMEOUT", 6)

    class Silent(remote.Link):  # never connects, never answers
        def __init__(self, node, inbox, connect_timeout):
            super().__init__(node, f"silent{node}", inbox)
            self.connect_timeout = connect_timeout

        def send(self, message):
            return True

        def close(self, wait=5.0):
            pass

        def unreachable(self):
            return f"unreachable after {self.connect_timeout} s"

    class Late(Silent):  # connects after 4 s, its agent says hello 4 s later: 8 s in all, each clock < 6 s
        def __init__(self, node, inbox):
            super().__init__(node, inbox, 6)

            def later():
                time.sleep(4)
                self.connected.set()
                time.sleep(4)
                self.heard({"type": "hello", "version": channel.version(), "gpus": 0, "python": "python3"})

            threading.Thread(target=later, daemon=True).start()

    class Run(remote.AgentRun):
        def open_links(self):
            return [Silent(0, self.inbox, 1), Late(1, self.inbox), Silent(2, self.inbox, 3)]

    run = Run(JobSpec(code="x", target="ssh", nodes=3, ssh={"hosts": ["a", "b", "c"]}), ["a", "b", "c"],
              ssh_target.SSHLauncher())
    t0 = time.monotonic()
    with pytest.raises(SpecError) as info:
        run.preflight()
    run.close_all()
    said = str(info.value)
    assert "2 of 3 host(s) cannot run the job" in said, said
    assert "a: unreachable after 1 s" in said and "c: unreachable after 3 s" in said and "\n  b:" not in said, said
    assert run.conns[1].hello is not None
    assert 7.5 < time.monotonic() - t0 < 12


# ---------------------------------------------------------------------------------- real hosts
@pytest.mark.slow
def test_three_hosts_train_like_the_local_run(ssh_hosts, hosts, tmp_path, jobs_dir):
    import torch

    import sdp_jupyter

    before = {i: hosts.bytes(i) for i in ssh_hosts.nodes}
    d = _drive(ssh_hosts, tmp_path / "remote", name="ssh-three", ranks_output="all")
    out = next_line(d)
    assert out.get("state") == "succeeded", out
    assert "3 node(s) x 1 proc(s) on ssh: h1, h2, h3, backend smddp" in out["summary"]
    # what the ranks really used reached the notebook through the mirrored metrics (launch/rank/backend_check.py)
    assert (out["status"]["backend_used"], out["status"]["warnings"]) == ("smddp", [])
    assert out["status"]["collectives"] >= 6 * 4  # 6 steps x 4 gradients, all_reduced on every host
    remote = pickle.load(open(os.path.join(out["dir"], "result.pkl"), "rb"))
    moved = {i: hosts.bytes(i)["tx"] - before[i]["tx"] for i in ssh_hosts.nodes}
    names = [n for n, _ in remote["hosts"]]
    assert names == ["h1", "h2", "h3"], remote["hosts"]
    assert [a for _, a in remote["hosts"]] == [hosts.addresses[i] for i in ssh_hosts.nodes]
    # 6 steps of a 540 KB gradient: every host sent well over a megabyte through its own link
    assert all(b > 1_000_000 for b in moved.values()), moved
    # the notebook side has what a local job's directory has: every rank's log, metrics, status
    logs = [open(os.path.join(out["dir"], "logs", f"rank-{r}.log")).read() for r in range(3)]
    assert all("step 5" in text for text in logs)
    assert os.path.exists(os.path.join(out["dir"], "metrics", "system-node-2.jsonl"))
    local = sdp_jupyter.launch(code=TRAIN, nodes=3, name="local-three")
    assert local.wait(timeout=180) == "succeeded", local.error
    assert torch.allclose(local.result()["params"], remote["params"], rtol=1e-5, atol=1e-6)
    assert ssh_hosts.wait_clean(10) == {}
    # the agents removed their files (no checkpoint was written)
    assert not any(ssh_hosts.agent_dir(i).joinpath("ssh-three").exists() for i in ssh_hosts.nodes)


@pytest.mark.slow
def test_bad_hosts_are_named_and_nothing_is_launched(ssh_hosts, hosts, tmp_path):
    hosts.cut(3)
    t0 = time.monotonic()
    d = _drive(ssh_hosts, tmp_path, ssh={"hosts": ["h1", "h3", "nosuchhost"], "config": str(ssh_hosts.config)})
    err = next_line(d)["spec_error"]
    assert time.monotonic() - t0 < link.CONNECT_TIMEOUT + 10  # both within the connect deadline
    assert err.startswith("--hosts: 2 of 3 host(s) cannot run the job; nothing was started")
    assert "\n  h3: " in err and "\n  nosuchhost: " in err and "ssh -o BatchMode=yes nosuchhost true" in err
    assert "h1:" not in err
    assert ssh_hosts.wait_clean(5) == {}
    hosts.heal(3)
    d = _drive(ssh_hosts, tmp_path, ssh={"hosts": ["h1", "h2"], "config": str(ssh_hosts.config),
                                         "python": "/usr/bin/python3"})
    err = next_line(d)["spec_error"]
    assert "h1: sdp_jupyter is not installed for /usr/bin/python3 there. Fix: install sdp_jupyter " in err
    d = _drive(ssh_hosts, tmp_path, ssh={"hosts": ["h1"], "config": str(ssh_hosts.config), "python": "/no/python"})
    assert "h1: /no/python does not run there" in next_line(d)["spec_error"]
    d = _drive(ssh_hosts, tmp_path, backend="nccl")
    err = next_line(d)["spec_error"]
    assert "nccl needs a GPU per process and it has none" in err and "--backend smddp" in err
    assert ssh_hosts.wait_clean(5) == {}


@pytest.mark.slow
def test_a_cut_link_is_named_and_every_host_is_cleaned(ssh_hosts, hosts, tmp_path):
    d = _drive(ssh_hosts, tmp_path, env={"STEPS": "100000", "STEP_SLEEP": "0.2"})
    assert "running" in next_line(d)
    hosts.cut(2)
    cut_at = time.time()
    tell(d, "wait")
    out = next_line(d, timeout=60)
    assert out.get("state") == "failed"
    # ssh's keep-alive (6 s) or our heartbeat (10 s), whichever ends first, names the host
    assert out["error"].startswith("host h2 (node 1)"), out["error"]
    assert "has not answered" in out["error"] or "the ssh connection closed (ssh exit 255" in out["error"]
    assert out["t"] - cut_at < remote.HEARTBEAT_TIMEOUT + 8
    # the other hosts' ranks are gone within seconds; the cut host's agent stops its own ranks when
    # the launcher's heartbeats stop (it cannot be told)
    t0 = time.monotonic()
    left = {i: ssh_hosts.processes(i) for i in (1, 3)}
    while any(left.values()) and time.monotonic() - t0 < 5:
        time.sleep(0.2)
        left = {i: ssh_hosts.processes(i) for i in (1, 3)}
    assert not any(left.values()), left
    assert ssh_hosts.wait_clean(channel.HEARTBEAT_TIMEOUT + 10) == {}


@pytest.mark.slow
def test_stop_and_a_killed_notebook_leave_nothing_anywhere(ssh_hosts, hosts, tmp_path):
    d = _drive(ssh_hosts, tmp_path, env={"STEPS": "100000", "STEP_SLEEP": "0.2"})
    assert "running" in next_line(d)
    tell(d, "stop")
    assert next_line(d)["stopped_in"] < 15
    assert next_line(d)["state"] == "stopped"
    assert ssh_hosts.wait_clean(5) == {}
    # the notebook's process is killed outright: its ssh clients die with it, the agents see their
    # channel close and stop the ranks
    d = _drive(ssh_hosts, tmp_path, env={"STEPS": "100000", "STEP_SLEEP": "0.2"})
    assert "running" in next_line(d)
    assert all(ssh_hosts.processes(i) for i in ssh_hosts.nodes)
    d.send_signal(signal.SIGKILL)
    d.wait()
    assert ssh_hosts.wait_clean(channel.HEARTBEAT_TIMEOUT + 5) == {}


@pytest.mark.slow
def test_a_failed_rank_restarts_the_job_on_every_host(ssh_hosts, hosts, tmp_path):
    # the default checkpoint folder is each host's own: every rank resumes from node 0's copy
    d = _drive(ssh_hosts, tmp_path, code=ELASTIC_TRAIN, env={"FAIL_AT": "2"}, max_restarts=1)
    out = next_line(d)
    assert out.get("state") == "succeeded" and out["restarts"] == 1, out
    logs = [open(os.path.join(out["dir"], "logs", f"rank-{r}.log")).read() for r in range(3)]
    assert "fails on purpose in attempt 0" in logs[2]
    # the restart names the rank that failed, not the peers whose collectives it broke
    assert "[sdp_jupyter] restart 1 of 1 after: rank 2 (node 2 on host h3, local rank 0) exited with code 1" in logs[2]
    assert all("attempt 1 world 3 from step 3" in log for log in logs), logs
    assert ssh_hosts.wait_clean(5) == {}


FROZEN = r'''
import os, signal, torch, torch.distributed as dist
dist.init_process_group("smddp")
for step in range(6):
    if step == 2 and dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent, holding its connections; its agent runs on
    dist.all_reduce(torch.ones(1000))
'''


@pytest.mark.slow
def test_a_rank_stopped_by_sigstop_is_killed_by_its_agent_and_named(ssh_hosts, hosts, tmp_path):
    t0 = time.monotonic()
    # the job's --env reaches the agents: their limit is the notebook's 4 s, not their own default 10 s
    d = _drive(ssh_hosts, tmp_path, code=FROZEN, env={"SDP_TIMEOUT": "120", "SDP_STOPPED_RANK_S": "4"})
    out = next_line(d, timeout=90)
    assert out.get("state") == "failed" and time.monotonic() - t0 < 60, out  # SDP_STOPPED_RANK_S, not 120 s
    assert out["error"].startswith("rank 1 (node 1 on host h2, local rank 0) was killed by signal SIGKILL"), out["error"]
    assert "was stopped by a signal (SIGSTOP) for 4 s: killed" in out["error"], out["error"]
    assert ssh_hosts.wait_clean(5) == {}


@pytest.mark.slow
def test_sdp_train_in_a_terminal_runs_on_the_ssh_hosts(ssh_hosts, tmp_path):
    import sys

    script = tmp_path / "hello.py"
    script.write_text("import socket, torch.distributed as dist\ndist.init_process_group('smddp')\n"
                      "print('hello from', socket.gethostname(), 'rank', dist.get_rank(), flush=True)\n")
    env = dict(os.environ, SDP_JOBS_DIR=str(tmp_path / "jobs"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    p = ssh_hosts.cluster.run(0, [sys.executable, "-m", "sdp_jupyter.cli", "--target", "ssh", "--hosts", "h2,h3",
                                  "--ssh-config", str(ssh_hosts.config), "--ranks-output", "all", str(script)],
                              env=env, timeout=120, check=False)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "hello from h2 rank 0" in p.stdout and "hello from h3 rank 1" in p.stdout
    assert ssh_hosts.wait_clean(5) == {}


def _warm_driver(hosts, jobs, runs):
    args = {"target": "ssh", "ssh": {"hosts": hosts.hosts[:2], "config": str(hosts.config)}, "jobs_dir": str(jobs)}
    return drive_session(hosts.cluster, args, runs)


def _pools(hosts) -> dict:
    """Processes on h1, h2 running the warm pool server (or forked from it: a warm rank)."""
    return {i: hosts.processes(i, "sdp_jupyter.launch.host.warm") for i in hosts.nodes[:2]}


def _wait_pools(hosts, want, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        found = _pools(hosts)
        if all(want(pids) for pids in found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


@pytest.mark.slow
def test_warm_starts_on_ssh_hosts_match_cold_and_die_with_the_notebook(ssh_hosts, hosts, tmp_path):
    # --warm starts a pool on each host; the next job (no flag) finds them and starts warm too; --cold
    # does not use them; all three train to the same bits
    d = _warm_driver(ssh_hosts, tmp_path / "jobs", [["w1", "warm", {}], ["w2", "auto", {}], ["c3", "cold", {}]])
    runs = [next_line(d, timeout=180) for _ in range(3)]
    for run in runs:
        assert run["state"] == "succeeded", run
    assert [r["status"].get("start") for r in runs] == ["warm", "warm", "cold"], [r["status"].get("start_reason") for r in runs]
    assert "start_reason" not in runs[0]["status"] and "warm start" in runs[0]["summary"]
    assert runs[0]["params"] == runs[1]["params"] == runs[2]["params"]
    # between jobs each host runs its pool server and nothing else of ours
    assert all(len(p) == 1 for p in _pools(ssh_hosts).values()), _pools(ssh_hosts)
    assert ssh_hosts.wait_clean(5) == {}
    tell(d, "exit")  # the notebook ends: its pools end with it
    d.wait(timeout=30)
    assert _wait_pools(ssh_hosts, lambda p: not p) == {1: [], 2: []}

    # a notebook killed outright while a warm job runs: its ssh clients die with it, and the pools, the
    # agents and the warm ranks (killed by their pool when their agent goes away) leave nothing behind
    d = _warm_driver(ssh_hosts, tmp_path / "jobs", [["w4", "warm", {"STEPS": "100000", "STEP_SLEEP": "0.2"}]])
    running = next_line(d, timeout=180)
    assert running["status"]["start"] == "warm", running
    assert all(len(p) == 2 for p in _pools(ssh_hosts).values()), _pools(ssh_hosts)  # server + the rank
    d.send_signal(signal.SIGKILL)
    d.wait()
    assert _wait_pools(ssh_hosts, lambda p: not p, timeout=channel.HEARTBEAT_TIMEOUT + 5) == {1: [], 2: []}
    assert ssh_hosts.wait_clean(channel.HEARTBEAT_TIMEOUT + 5) == {}
