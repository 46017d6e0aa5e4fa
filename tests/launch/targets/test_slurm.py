"""The Slurm target on a real Slurm (slurmctld on h0, slurmd on h1..h3; sdp_jupyter.testing.slurm):
jobs train like the local run, wait in the queue with Slurm's reason, stop, lose a node, hit the time
limit, resume from a checkpoint in a new allocation, and are refused before anything is queued; Slurm's
own record of each allocation says how the job ended (COMPLETED, FAILED, CANCELLED)."""
from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import pytest

from helpers.heal_job import HEAL_JOB, check_remote_heal
from helpers.remote_jobs import LAUNCH, REPO, RUN_FUNCTION, TRAIN, drive_cells, next_line
from sdp_jupyter.launch import Job, JobSpec, SpecError
from sdp_jupyter.launch.targets.slurm import launcher as slurm
from sdp_jupyter.testing.cluster import signal_all

# Plays the notebook on h0 (the login node): launches, says {"job": name}, then obeys commands on
# stdin: "status" -> {"status"}, "stop" -> {"stopped_in"}, "wait" -> the end {"state", ...}.
DRIVER = LAUNCH + r'''
print(json.dumps({"job": job.name, "dir": str(job.dir), "t0": t0}), flush=True)
for line in sys.stdin:
    command = line.strip()
    if command == "status":
        print(json.dumps({"status": job.status, "where": job.where_label, "state": job.state}), flush=True)
    elif command == "stop":
        t = time.monotonic(); job.stop()
        print(json.dumps({"stopped_in": time.monotonic() - t, "state": job.state}), flush=True)
    elif command == "wait":
        job.wait()
        print(json.dumps({"state": job.state, "error": job.error, "dir": str(job.dir), "status": job.status,
                          "summary": job.summary(), "logs": job.logs(0)}), flush=True)
'''

CHECKPOINTED = r'''
import os, torch, torch.distributed as dist
dist.init_process_group("smddp")
ck = os.path.join(os.environ["SDP_CHECKPOINT_DIR"], "step.txt")
start = int(open(ck).read()) if os.path.exists(ck) else 0
for step in range(start, 6):
    t = torch.ones(1)
    dist.all_reduce(t)
    if dist.get_rank() == 0:
        open(ck, "w").write(str(step + 1))
    if step == 2 and os.environ["SDP_RESTART"] == "0":
        raise SystemExit("every rank fails on purpose after step 2 of the first allocation")
(start, os.environ["SDP_RESTART"], os.environ["SLURM_JOB_ID"])
'''


def _drive(sh, jobs, code=TRAIN, prefix=(), env=None, driver=DRIVER, **args):
    full = sh.env(env)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    full.pop("SLURM_JOB_ID", None)
    spec = {"code": code, "target": "slurm", "jobs_dir": str(jobs), **args}
    proc = sh.cluster.popen(0, list(prefix) + [sys.executable, "-c", driver, json.dumps(spec)], env=full, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.jobs_dir = str(jobs)  # next_line shows the jobs' status and logs when the driver goes quiet
    return proc


def _say(proc, command: str, timeout: float = 120.0) -> dict:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()
    return next_line(proc, timeout=timeout)


def _until(proc, ready, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        line = _say(proc, "status")
        if ready(line) or time.monotonic() > deadline:
            return line
        time.sleep(0.3)


def _block(sh, nodes: int = 3) -> str:
    """A job of someone else's that holds `nodes` nodes (ours then waits for Resources)."""
    p = sh.run(["sbatch", "--parsable", f"--nodes={nodes}", "--exclusive", "--job-name=blocker", "--output=/dev/null",
                "--wrap", "sleep 300"])
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip()
    deadline = time.monotonic() + 30
    while "RUNNING" not in sh.run(["squeue", "-h", "-j", job, "-o", "%T"]).stdout and time.monotonic() < deadline:
        time.sleep(0.2)
    return job


# ---------------------------------------------------------------------------------- no cluster needed
def test_slurm_options_need_the_slurm_target_and_gpus_come_from_the_request():
    with pytest.raises(SpecError) as e:
        JobSpec(code="pass", slurm={"partition": "debug"})
    assert e.value.option == "--partition" and "--target slurm" in str(e.value)
    from sdp_jupyter.magics import SdpMagics, parse_line

    line = '--target slurm --partition gpu --time 30 --slurm-args "--qos=high --gres=gpu:a100:4"'
    spec = JobSpec.from_options(vars(parse_line(SdpMagics.sdp_train, line)), code="pass")
    assert spec.slurm == {"partition": "gpu", "time": "30", "args": "--qos=high --gres=gpu:a100:4"}
    argv = slurm.sbatch_argv(spec, "n1")
    assert argv[:2] == ["sbatch", "--parsable"] and "--partition=gpu" in argv and "--time=30" in argv
    assert argv[-2:] == ["--qos=high", "--gres=gpu:a100:4"]
    assert slurm.gpus_asked(slurm.extra_args(spec.slurm)) == 4
    assert slurm.gpus_asked(["--gpus-per-node=8"]) == 8 and slurm.gpus_asked(["--qos=x"]) == 0
    assert [slurm.minutes(t) for t in ("30", "5:30", "1:30:00", "2-0", "1-12:30", "UNLIMITED")] == \
        [30, 5.5, 90, 2880, 2190, None]
    with pytest.raises(SpecError, match="not a Slurm time"):
        slurm.minutes("soon")
    with pytest.raises(SpecError, match="nccl needs a GPU per process"):
        slurm.SlurmLauncher().resolve(JobSpec(code="pass", target="slurm", backend="nccl"))


def test_without_sbatch_the_error_says_where_to_run():
    with pytest.raises(SpecError) as e:
        slurm.run(["sbatch-that-is-not-here", "--version"])
    assert e.value.option == "--target" and "not on the PATH" in str(e.value)


# ---------------------------------------------------------------------------------- a real Slurm
@pytest.mark.slow
def test_run_a_notebook_function_on_slurm_nodes(slurm_hosts, tmp_path):
    out = next_line(_drive(slurm_hosts, tmp_path, driver=RUN_FUNCTION, nodes=2, backend="gloo"), timeout=180)
    assert [v[0] for v in out["values"]] == [0, 1] and all(v[2:] == [2, 60] for v in out["values"]), out
    hosts = {v[1] for v in out["values"]}
    assert len(hosts) == 2 and hosts <= set(slurm_hosts.names), out  # one rank on each of two Slurm nodes


@pytest.mark.slow
def test_two_and_three_nodes_train_like_the_local_run(slurm_hosts, hosts, tmp_path, jobs_dir):
    import torch

    import sdp_jupyter

    for n in (2, 3):
        before = {i: hosts.bytes(i)["tx"] for i in slurm_hosts.nodes[:n]}
        d = _drive(slurm_hosts, tmp_path / f"remote{n}", name=f"slurm-{n}", nodes=n, ranks_output="all")
        started = next_line(d, timeout=60)
        end = _say(d, "wait", timeout=180)
        assert end["state"] == "succeeded", end
        st = end["status"]
        assert f"{n} node(s) x 1 proc(s) on slurm job {st['slurm_job_id']}: " in end["summary"]
        assert sorted(st["host_names"]) == slurm_hosts.names[:n]
        moved = {i: hosts.bytes(i)["tx"] - before[i] for i in before}
        assert all(b > 1_000_000 for b in moved.values()), moved  # gradients crossed every node's link
        remote = pickle.load(open(os.path.join(end["dir"], "result.pkl"), "rb"))
        reopened = Job.open(end["dir"])  # what a restarted kernel finds: the record, with its Slurm id
        assert reopened.state == "succeeded" and reopened.where_label.startswith(f"slurm job {st['slurm_job_id']}: ")
        local = sdp_jupyter.launch(code=TRAIN, nodes=n, name=f"local-{n}")
        assert local.wait(timeout=180) == "succeeded", local.error
        assert torch.allclose(local.result()["params"], remote["params"], rtol=1e-5, atol=1e-6)
        print(f"\n[slurm] {n} nodes: cell start to ranks running {st['started'] - started['t0']:.2f} s, "
              f"whole job {st['ended'] - started['t0']:.2f} s; test cluster daemons "
              f"{slurm_hosts.memory_mb():.0f} MB resident")
        d.stdin.close()
        d.wait(timeout=30)
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_a_queued_job_shows_slurms_reason_then_runs_and_stop_works_pending_and_running(slurm_hosts, tmp_path):
    blocker = _block(slurm_hosts)
    try:
        d = _drive(slurm_hosts, tmp_path, name="queued", nodes=2)
        next_line(d, timeout=60)
        line = _until(d, lambda x: x["status"].get("pending_reason") == "Resources")
        assert line["state"] == "pending" and line["where"].endswith("(pending: Resources)"), line
        slurm_hosts.run(["scancel", blocker])
        end = _say(d, "wait", timeout=120)
        assert end["state"] == "succeeded", end
        d.stdin.close()

        blocker = _block(slurm_hosts)
        d = _drive(slurm_hosts, tmp_path, name="stopped-pending", nodes=2)
        next_line(d, timeout=60)
        _until(d, lambda x: x["status"].get("pending_reason") == "Resources")
        stopped = _say(d, "stop")
        assert stopped["state"] == "stopped" and stopped["stopped_in"] < 10, stopped
        d.stdin.close()
    finally:
        slurm_hosts.run(["scancel", blocker])
    d = _drive(slurm_hosts, tmp_path, name="stopped-running", nodes=3, env={**os.environ, "STEPS": "100000",
                                                                           "STEP_SLEEP": "0.2"})
    next_line(d, timeout=60)
    _until(d, lambda x: x["state"] == "running" and x["status"].get("host_names"))
    stopped = _say(d, "stop")
    assert stopped["state"] == "stopped" and stopped["stopped_in"] < 15, stopped
    d.stdin.close()
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_a_lost_node_is_named_and_the_time_limit_is_reported_as_such(slurm_hosts, tmp_path):
    from sdp_jupyter.launch.kernel.agent_run.run import HEARTBEAT_TIMEOUT

    long = {**os.environ, "STEPS": "100000", "STEP_SLEEP": "0.2"}
    d = _drive(slurm_hosts, tmp_path, name="lost", nodes=3, env=long)
    next_line(d, timeout=60)
    _until(d, lambda x: x["state"] == "running" and x["status"].get("host_names"))
    time.sleep(2)
    killed = time.monotonic()
    # the node's part of the job is gone (slurmd stays: Slurm did not see it)
    signal_all(slurm_hosts.processes(3, "sdp_jupyter.launch.host.agent") + slurm_hosts.processes(3), signal.SIGKILL)
    end = _say(d, "wait", timeout=60)
    assert end["state"] == "failed" and "host h3 (node 2)" in end["error"], end
    assert time.monotonic() - killed < HEARTBEAT_TIMEOUT + 5
    d.stdin.close()

    d = _drive(slurm_hosts, tmp_path, name="timed", nodes=2, env=long)
    next_line(d, timeout=60)
    line = _until(d, lambda x: x["state"] == "running" and x["status"].get("host_names"))
    job_id = line["status"]["slurm_job_id"]
    p = slurm_hosts.run(["scontrol", "update", f"JobId={job_id}", "TimeLimit=0:01"])  # 1 s: over at once
    assert p.returncode == 0, p.stderr
    end = _say(d, "wait", timeout=120)
    assert end["state"] == "failed" and f"Slurm ended allocation {job_id}: TIMEOUT" in end["error"], end
    d.stdin.close()
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_an_elastic_job_goes_on_in_its_allocation_when_a_node_is_set_down(slurm_hosts, tmp_path):
    """--nodes 2:3 asks Slurm for 3 nodes with --no-kill: node h3 fails (set DOWN, its processes gone), srun
    cannot start its agent again, and the job re-forms on h1 and h2 from its checkpoint (a copy on every
    node) in the same allocation."""
    from helpers.remote_jobs import ELASTIC_TRAIN

    name = f"elastic-{time.time_ns()}"  # the hosts keep a job name's checkpoints: a new name starts at step 0
    d = _drive(slurm_hosts, tmp_path, code=ELASTIC_TRAIN, name=name, nodes="2:3",
               env={**os.environ, "STEPS": "60", "STEP_SLEEP": "0.2"})
    next_line(d, timeout=60)
    line = _until(d, lambda x: x["state"] == "running" and len(x["status"].get("host_names") or []) == 3)
    job_id = line["status"]["slurm_job_id"]
    log = tmp_path / name / "logs" / "rank-0.log"
    _until(d, lambda x: log.exists() and "step 3" in log.read_text())
    try:
        # the node fails: Slurm sets it DOWN, and what ran on it is gone (a DOWN node's steps are not ended
        # at once, so the test ends them as a dead machine would)
        p = slurm_hosts.run(["scontrol", "update", "NodeName=h3", "State=DOWN", "Reason=elastic-test"])
        assert p.returncode == 0, p.stderr
        signal_all(slurm_hosts.processes(3, "sdp_jupyter.launch.host.agent") + slurm_hosts.processes(3), signal.SIGKILL)
        end = _say(d, "wait", timeout=150)
    finally:
        slurm_hosts.run(["scontrol", "update", "NodeName=h3", "State=RESUME"])
    assert end["state"] == "succeeded", end["error"]
    formations = [e for e in end["status"]["membership"] if "hosts" in e]
    assert [f["hosts"] for f in formations] == [["h1", "h2", "h3"], ["h1", "h2"]], end["status"]["membership"]
    assert "h3" in formations[1]["lost"] and end["status"].get("restarts", 0) == 0
    assert end["status"]["slurm_jobs"] == [job_id]  # the same allocation: nothing queued again
    assert "attempt 1 world 2 from step" in end["logs"]
    d.stdin.close()
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_a_dead_rank_is_replaced_in_the_allocation_while_the_others_keep_their_processes(slurm_hosts, tmp_path):
    """--heal in one allocation: rank 1 SIGKILLs itself in step 20, its node's agent (started by srun)
    starts it again, the others keep their processes; nothing is resubmitted."""
    d = _drive(slurm_hosts, tmp_path, code=HEAL_JOB, name="slurm-heal", nodes=3, heal=True, max_restarts=2,
               backend="smddp", ranks_output="all", env={**os.environ, "DIES": "1", "SIG": "SIGKILL"})
    next_line(d, timeout=60)
    end = _say(d, "wait", timeout=240)
    check_remote_heal(end, 3, dies=1)
    assert len(end["status"]["slurm_jobs"]) == 1, end["status"]
    d.stdin.close()
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_a_failure_is_resubmitted_and_resumes_from_the_checkpoint(slurm_hosts, tmp_path):
    # on shared storage, as a cluster's checkpoints are: every rank of the new allocation reads the step
    d = _drive(slurm_hosts, tmp_path, code=CHECKPOINTED, name="resumed", nodes=2, max_restarts=1,
               checkpoint_dir=str(tmp_path / "shared-checkpoints"))
    next_line(d, timeout=60)
    end = _say(d, "wait", timeout=180)
    assert end["state"] == "succeeded", end
    first, second = end["status"]["slurm_jobs"]
    assert first != second and end["status"]["restarts"] == 1
    start, restart, job_id = pickle.load(open(os.path.join(end["dir"], "result.pkl"), "rb"))
    assert (start, restart, job_id) == (3, "1", second)
    d.stdin.close()
    assert slurm_hosts.wait_clean(30) == {}


def _slurm_record(sh, job_id: str) -> tuple[str, str]:
    """Slurm's own record of an allocation once it has ended: (state, exit code), as `squeue --states=all`
    shows it (the test cluster keeps finished jobs for MinJobAge; it has no accounting storage for sacct)."""
    deadline = time.monotonic() + 15
    while True:
        state = sh.run(["squeue", "--states=all", "-h", "-j", job_id, "-o", "%T"]).stdout.strip()
        if state not in ("RUNNING", "COMPLETING", "PENDING") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    fields = dict(w.split("=", 1) for w in sh.run(["scontrol", "-o", "show", "job", job_id]).stdout.split() if "=" in w)
    return state, fields.get("ExitCode", "?")


@pytest.mark.slow
def test_slurms_record_of_the_allocation_says_how_the_job_ended(slurm_hosts, tmp_path):
    """Succeeded: COMPLETED; failed: FAILED; stopped: CANCELLED; abandoned by its notebook: FAILED (exit 3)."""
    ended = {}
    for name, code in (("ok", "sum(range(4))"), ("bad", "raise SystemExit('fails on purpose')")):
        d = _drive(slurm_hosts, tmp_path, code=code, name=f"record-{name}", nodes=1)
        next_line(d, timeout=60)
        ended[name] = _say(d, "wait", timeout=120)
        d.stdin.close()
    d = _drive(slurm_hosts, tmp_path, code="import time; time.sleep(600)", name="record-stopped", nodes=1)
    next_line(d, timeout=60)
    _until(d, lambda x: x["state"] == "running" and x["status"].get("host_names"))
    assert _say(d, "stop")["state"] == "stopped"
    ended["stopped"] = _say(d, "wait")
    d.stdin.close()
    assert (ended["ok"]["state"], ended["bad"]["state"]) == ("succeeded", "failed"), ended
    records = {name: _slurm_record(slurm_hosts, end["status"]["slurm_job_id"]) for name, end in ended.items()}
    assert records == {"ok": ("COMPLETED", "0:0"), "bad": ("FAILED", "1:0"), "stopped": ("CANCELLED", "0:15")}, records
    assert {name: end["status"]["slurm_state"] for name, end in ended.items()} == \
        {"ok": "COMPLETED", "bad": "FAILED", "stopped": "CANCELLED"}  # the job view says what Slurm says

    # the holder's own safety: no agent ever came (the notebook went away) ends the allocation, FAILED
    holder = slurm.HOLDER.replace(f"-ge {slurm.HOLD_FIRST}", "-ge 2")
    assert holder != slurm.HOLDER
    script = tmp_path / "holder.sh"
    script.write_text(holder)
    p = slurm_hosts.run(["sbatch", "--parsable", "--nodes=1", "--output=/dev/null", str(script)])
    assert p.returncode == 0, p.stderr
    assert _slurm_record(slurm_hosts, p.stdout.strip()) == ("FAILED", f"{slurm.ABANDONED}:0")
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
def test_inside_an_allocation_the_job_runs_there(slurm_hosts, tmp_path):
    d = _drive(slurm_hosts, tmp_path, prefix=["salloc", "--nodes=2", "--quiet"], name="inside", nodes=2)
    next_line(d, timeout=60)
    end = _say(d, "wait", timeout=120)
    assert end["state"] == "succeeded" and end["status"]["slurm_inside"], end
    assert "slurm_jobs" not in end["status"]  # nothing was submitted
    d.stdin.close()
    d.wait(timeout=30)
    assert slurm_hosts.wait_clean(30) == {}


@pytest.mark.slow
@pytest.mark.parametrize("args, option, said", [
    ({"slurm": {"partition": "nosuch"}}, "--partition", "no partition 'nosuch'"),
    ({"slurm": {"partition": "short"}, "nodes": 2}, "--nodes", "2 nodes cannot be allocated"),
    ({"slurm": {"partition": "short", "time": "5"}}, "--time", "over partition short's limit of 1 minute"),
    ({"backend": "nccl"}, "--backend", "nccl needs a GPU per process"),
])
def test_what_slurm_would_refuse_is_refused_before_anything_is_queued(slurm_hosts, tmp_path, args, option, said):
    d = _drive(slurm_hosts, tmp_path, **args)
    line = next_line(d, timeout=60)
    assert line.get("option") == option and said in line["spec_error"], line
    assert slurm_hosts.jobs() == []


@pytest.mark.slow
def test_a_session_keeps_its_ranks_in_an_allocation(slurm_hosts, tmp_path):
    """An interactive session (docs/session.md) on Slurm: the cells reach the ranks through the agents."""
    drive_cells(slurm_hosts.cluster, {"target": "slurm", "nodes": 3, "jobs_dir": str(tmp_path / "jobs")},
                slurm_hosts.names, env=slurm_hosts.env())
    assert slurm_hosts.wait_clean(30) == {}
