"""End-to-end: real worker processes started by the local launcher (and by sdp-train)."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO, job_processes, wait_no_processes, worker_processes
from sdp_jupyter.launch import Job, JobSpec, LocalLauncher, launch
from sdp_jupyter.launch.kernel.job import read_metrics_lines

pytestmark = pytest.mark.slow


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return path


def test_environment_output_and_result(tmp_path, jobs_dir):
    script = write(tmp_path / "env.py", """
        import json, os, sys
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "SM_HOSTS", "SM_CURRENT_HOST", "SM_NUM_GPUS", "SM_MODEL_DIR",
                "SM_OUTPUT_DATA_DIR", "SM_CHANNEL_TRAIN", "SM_HPS", "SDP_JOB_SECRET", "SDP_CHECKPOINT_DIR"]
        print(json.dumps({k: os.environ[k] for k in keys} | {"argv": sys.argv[1:], "main": __name__}))
        print("to stderr from", os.environ["RANK"], file=sys.stderr)
        import sdp_jupyter
        for step in range(3):
            sdp_jupyter.report(step=step, samples=8, loss=1.0 / (step + 1))
        {"rank": int(os.environ["RANK"]), "argv": sys.argv[1:]}
    """)
    job = launch(script, nodes=2, procs_per_node=2, backend="gloo", args=["--x", "1"],
                 hyperparameters={"lr": 0.25}, name="envs")
    assert job.wait(60) == "succeeded", job.summary()
    assert job.dir == jobs_dir / "envs"
    seen = []
    for rank in range(4):
        first, second = job.logs(rank).splitlines()[:2]
        env = json.loads(first)
        assert second == f"to stderr from {rank}"  # stdout and stderr merged, per rank
        node, local = divmod(rank, 2)
        assert (env["RANK"], env["LOCAL_RANK"], env["GROUP_RANK"]) == (str(rank), str(local), str(node))
        assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
        assert env["SM_CURRENT_HOST"] == f"algo-{node + 1}" and json.loads(env["SM_HOSTS"]) == ["algo-1", "algo-2"]
        assert env["argv"] == ["--x", "1", "--lr", "0.25"] and env["main"] == "__main__"
        assert json.loads(env["SM_HPS"]) == {"lr": 0.25}
        assert os.path.isdir(env["SM_MODEL_DIR"]) and os.path.isdir(env["SDP_CHECKPOINT_DIR"])
        seen.append((env["MASTER_PORT"], env["SDP_JOB_SECRET"]))
    assert len(set(seen)) == 1  # one port and one secret per job
    assert job.result() == {"rank": 0, "argv": ["--x", "1", "--lr", "0.25"]}
    assert job.exit_codes == [0, 0, 0, 0]
    # the job directory alone is enough to reopen it
    again = Job.open("envs")
    assert (again.state, again.exit_codes, again.result()) == ("succeeded", [0, 0, 0, 0], job.result())
    assert again.logs(3, tail=1) == "to stderr from 3\n"
    assert json.loads((job.dir / "spec.json").read_text())["nodes"] == 2
    # metrics: through the monitor's reader when installed, else the raw lines
    frame = job.metrics()
    if isinstance(frame, list):
        steps = [m for m in frame if m.get("kind") == "step"]
        assert sorted((m["rank"], m["step"]) for m in steps) == [(r, s) for r in range(4) for s in range(3)]
    else:
        assert sorted(frame.ranks) == [0, 1, 2, 3] and frame.steps[0]["loss"][-1] == pytest.approx(1 / 3)
    raw = read_metrics_lines(job.dir)
    assert len([m for m in raw if m.get("kind") == "step"]) == 12


def test_an_env_value_with_a_line_break_keeps_the_cells_line_numbers(jobs_dir):
    """script.py's first line is the magic line as a comment (so a traceback's line numbers are the
    cell.s, the magic line being line 1): an --env value holding a line break once ended that comment, and every rank failed with a
    SyntaxError on the rest of the option line."""
    code = "import os\nprint(repr(os.environ['MULTI']))\nraise ValueError('on purpose')\n"
    job = launch(code=code, nodes=1, backend="gloo", env={"MULTI": "a\nb"}, name="multi-line-env")
    assert job.wait(60) == "failed"
    log = job.logs(0)
    assert "'a\\nb'" in log and "line 4" in log and "ValueError: on purpose" in log, log
    assert "SyntaxError" not in log, log


def test_metrics_without_the_monitor_reader(tmp_path, monkeypatch):
    import importlib.util

    from sdp_jupyter.launch.kernel import job as job_module

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank-0.jsonl").write_text('{"t": 2, "kind": "step", "step": 1}\n{"t": 1, "kind": "st')
    (tmp_path / "metrics" / "rank-1.jsonl").write_text('{"t": 1.5, "kind": "step", "step": 0}\nnot json\n')
    real = importlib.util.find_spec
    monkeypatch.setattr(job_module.importlib.util, "find_spec",
                        lambda name, *a: None if name == "sdp_jupyter.monitor.reader" else real(name, *a))
    job = Job(JobSpec(code="x"), tmp_path)
    assert [m["step"] for m in job.metrics()] == [0, 1]  # sorted by time; partial and bad lines skipped


def test_two_torch_jobs_at_once_torchrun_style(tmp_path, jobs_dir):
    script = write(tmp_path / "allreduce.py", """
        import os, torch, torch.distributed as dist
        dist.init_process_group(os.environ["SDP_BACKEND"])  # env:// from torchrun's variables
        t = torch.full((4,), float(dist.get_rank() + 1) * float(os.environ["SCALE"]))
        dist.all_reduce(t)
        print("sum", t.tolist())
        dist.destroy_process_group()
        t.tolist()
    """)
    a = launch(script, nodes=3, env={"SCALE": "1"}, name="a")  # default backend: smddp
    b = launch(script, nodes=2, backend="gloo", env={"SCALE": "10"}, name="b")
    assert a.wait(120) == "succeeded", a.summary()
    assert b.wait(120) == "succeeded", b.summary()
    assert a.result() == [6.0] * 4 and b.result() == [30.0] * 4
    assert (a.spec.backend, b.spec.backend) == ("smddp", "gloo")
    assert a.status["port"] != b.status["port"]
    assert json.loads((a.dir / "status.json").read_text())["state"] == "succeeded"


@pytest.mark.parametrize("backend", ["smddp", "gloo"])
def test_the_error_names_the_rank_that_failed_not_the_peers_it_took_down(tmp_path, jobs_dir, backend):
    """Rank 2 raises after step 2; ranks 0 and 1 fail in their next all_reduce and, having less to
    tear down, usually end first. The job's error names rank 2 (every time, before: rank 0 or 1)."""
    script = write(tmp_path / "peer.py", f"""
        import os, torch, torch.distributed as dist
        dist.init_process_group("{backend}")
        rank, world = dist.get_rank(), dist.get_world_size()
        for step in range(6):
            dist.all_reduce(torch.ones(1000))
            if step == 2 and rank == world - 1:
                raise SystemExit(f"rank {{rank}} fails on purpose after step {{step}}")
    """)
    job = launch(script, nodes=3, backend=backend, name=f"peer-{backend}")
    assert job.wait(120) == "failed"
    first, last_line = job.error.splitlines()[:2]
    assert first == "rank 2 (node 2, local rank 0) exited with code 1; its last lines:", job.error
    assert last_line == "rank 2 fails on purpose after step 2", job.error
    assert "(ranks 0-1 failed too, after it: their collectives lost a peer." in job.error


def test_a_rank_stopped_by_sigstop_is_killed_and_named_long_before_the_timeout(tmp_path, jobs_dir, monkeypatch):
    monkeypatch.setenv("SDP_STOPPED_RANK_S", "2")
    script = write(tmp_path / "frozen.py", """
        import os, signal, torch, torch.distributed as dist
        dist.init_process_group("smddp")
        for step in range(6):
            if step == 3 and dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGSTOP)  # alive, silent, holding its connections
            dist.all_reduce(torch.ones(1000))
    """)
    t0 = time.monotonic()
    job = launch(script, nodes=2, name="frozen", env={"SDP_TIMEOUT": "120"})
    assert job.wait(60) == "failed"
    assert time.monotonic() - t0 < 40  # not SDP_TIMEOUT's 120 s
    assert job.error.startswith("rank 1 (node 1, local rank 0) was killed by signal SIGKILL"), job.error
    assert "was stopped by a signal (SIGSTOP) for 2 s: killed" in job.error, job.error


def test_failed_rank_stops_the_others_with_escalating_signals(tmp_path, jobs_dir):
    script = write(tmp_path / "fail.py", """
        import os, signal, sys, time
        rank = int(os.environ["RANK"])
        if rank == 1:
            time.sleep(0.5)
            print("about to fail")
            sys.exit(3)
        if rank == 2:  # a stubborn rank: only SIGKILL ends it
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("working", flush=True)
        time.sleep(120)
    """)
    job = LocalLauncher(sigint_grace=1.0, sigterm_grace=1.0).start(
        JobSpec(script=str(script), nodes=3, backend="gloo", name="fails"))
    t0 = time.monotonic()
    assert job.wait(60) == "failed"
    assert time.monotonic() - t0 < 30
    assert job.error.startswith("rank 1 (node 1, local rank 0) exited with code 3")
    assert "about to fail" in job.error
    codes = job.exit_codes
    assert codes[1] == 3 and codes[0] == -signal.SIGINT and codes[2] == -signal.SIGKILL
    with pytest.raises(Exception, match="rank 1 .* exited with code 3"):
        job.raise_for_state()


def test_stop_timeout_and_grandchildren_leave_no_process(tmp_path, jobs_dir):
    script = write(tmp_path / "sleepy.py", """
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # a grandchild
        print("started", flush=True)
        time.sleep(300)
    """)
    job = launch(script, nodes=2, backend="gloo", name="stopme")
    deadline = time.monotonic() + 60
    while "started" not in job.logs(1) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(job_processes(job.dir)) >= 4  # 2 ranks + 2 grandchildren (+ samplers)
    assert job.stop() == "stopped"
    assert job.exit_codes == [-signal.SIGINT, -signal.SIGINT]
    assert wait_no_processes(job.dir) == []

    timed = launch(script, nodes=1, backend="gloo", name="timed", timeout=2)
    assert timed.wait(60) == "failed" and "timed out after 2 s" in timed.error
    assert wait_no_processes(timed.dir) == []


RESUME = """
    import os, signal, torch, torch.distributed as dist
    from sdp_jupyter import checkpoint
    dist.init_process_group(os.environ["SDP_BACKEND"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    state = checkpoint.load()
    start = 0
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
        print("resumed at step", start)
    g = torch.Generator().manual_seed(1)
    X, Y = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g)
    for step in range(start, 12):
        if step == 7 and rank == 1 and os.environ["SDP_RESTART"] == "0" and os.environ.get("CRASH") == "1":
            os.kill(os.getpid(), signal.SIGKILL)  # dies mid-training, no clean exit
        idx = torch.arange(step * 4 + rank * 2, step * 4 + rank * 2 + 2) % 64
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(X[idx]), Y[idx]).backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        checkpoint.save({"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict()})
    dist.destroy_process_group()
    {k: v.clone() for k, v in model.state_dict().items()}
"""


def test_restart_resumes_from_checkpoint_with_the_same_result(tmp_path, jobs_dir):
    script = write(tmp_path / "resume.py", RESUME)
    crashed = launch(script, nodes=2, backend="gloo", max_restarts=1, env={"CRASH": "1"}, name="crash")
    clean = launch(script, nodes=2, backend="gloo", name="clean")
    assert crashed.wait(180) == "succeeded", crashed.summary()
    assert clean.wait(180) == "succeeded", clean.summary()
    assert crashed.restarts == 1 and clean.restarts == 0
    assert crashed.error is None
    [cause] = crashed.status["restart_errors"]  # the failure that caused the restart is kept
    assert cause.startswith("rank 1 (node 1, local rank 0) was killed by signal SIGKILL")
    log0 = crashed.logs(0)
    assert "restart 1 of 1" in log0 and "resumed at step" in log0
    resumed_at = int(log0.split("resumed at step")[1].split()[0])
    assert 1 <= resumed_at <= 8
    a, b = crashed.result(), clean.result()
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k  # bit-identical parameters
    # a run that was never interrupted must differ from one that skipped steps: the test can fail
    assert not (a["weight"] == launch_result_after_skipping(tmp_path, jobs_dir)).all()


def launch_result_after_skipping(tmp_path, jobs_dir):
    """Resume from a checkpoint whose step counter was tampered with: parameters must come out different."""
    job = Job.open("clean")
    import torch

    ckpt = torch.load(job.dir / "checkpoints" / "checkpoint.pt", weights_only=False)
    ckpt["step"] = 10
    torch.save(ckpt, tmp_path / "checkpoint.pt")
    skip = launch(str(tmp_path / "resume.py"), nodes=2, backend="gloo", name="skip",
                  checkpoint_dir=str(tmp_path))
    assert skip.wait(180) == "succeeded", skip.summary()
    return skip.result()["weight"]


@pytest.mark.parametrize("backend", ["smddp", "gloo"])
def test_smdistributed_old_api_script_runs_unchanged(tmp_path, jobs_dir, backend):
    script = write(tmp_path / "smddp_v1.py", """
        import torch
        import smdistributed.dataparallel
        import smdistributed.dataparallel.torch.distributed as dist
        from smdistributed.dataparallel.torch.parallel.distributed import DistributedDataParallel as DDP
        dist.init_process_group()
        assert dist.get_world_size() == 2 and dist.get_local_rank() == 0
        torch.manual_seed(dist.get_rank())  # different init on each rank: DDP must broadcast rank 0's
        model = DDP(torch.nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x = torch.ones(8, 4) * (dist.get_rank() + 1)
        model(x).sum().backward()
        opt.step()
        w = model.module.weight.detach().clone()
        gathered = [torch.zeros_like(w) for _ in range(2)]
        dist.all_gather(gathered, w)
        assert torch.equal(gathered[0], gathered[1]), "replicas diverged"
        print("compat", smdistributed.dataparallel.__version__)
        w.tolist()
    """)
    job = launch(script, nodes=2, backend=backend, name="smddp-v1")
    assert job.wait(120) == "succeeded", job.summary() + job.logs(0) + job.logs(1)
    assert "compat sdp_jupyter-compat" in job.logs(0)


@pytest.mark.skipif(importlib.util.find_spec("sdp_jupyter.torch") is None,
                    reason="the smddp backend (sdp_jupyter.torch) has not landed")
def test_smdistributed_torch_smddp_script_on_our_engine(tmp_path, jobs_dir):
    script = write(tmp_path / "smddp_v2.py", """
        import torch, torch.distributed as dist
        import smdistributed.dataparallel.torch.torch_smddp  # registers "smddp"
        dist.init_process_group(backend="smddp")
        t = torch.arange(5, dtype=torch.float32) * (dist.get_rank() + 1)
        dist.all_reduce(t)
        dist.destroy_process_group()
        t.tolist()
    """)
    job = launch(script, nodes=2)  # default backend: smddp
    assert job.spec.backend == "smddp"
    assert job.wait(120) == "succeeded", job.summary() + job.logs(0) + job.logs(1)
    assert job.result() == [0.0, 3.0, 6.0, 9.0, 12.0]


LAUNCHER = """
import sys, time
import sdp_jupyter
job = sdp_jupyter.launch(sys.argv[1], nodes=2, backend="gloo", name="parent")
while "up" not in job.logs(1):
    time.sleep(0.05)
print("launched", flush=True)
sys.stdin.readline()
if sys.argv[2] == "hang":
    time.sleep(300)
"""


@pytest.mark.parametrize("how", ["SIGKILL", "exit"])
def test_workers_die_with_the_launching_process(tmp_path, jobs_dir, how):
    script = write(tmp_path / "up.py", "import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    parent = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(script), "hang" if how == "SIGKILL" else "exit"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert parent.stdout.readline().strip() == "launched"
    workers = worker_processes(jobs_dir)
    assert len(workers) == 2
    parent.stdin.write("go\n")
    parent.stdin.flush()
    if how == "SIGKILL":
        parent.kill()  # the kernel dies: the parent-death signal takes the workers along
    parent.wait(30)
    assert wait_no_processes(jobs_dir) == []
    if how == "exit":  # a clean exit (kernel shutdown) marks the job stopped via atexit
        assert Job.open("parent").state == "stopped"
    else:
        assert "launcher" in Job.open("parent").error


def test_cli(tmp_path, jobs_dir):
    ok = write(tmp_path / "ok.py", "import os, sys\nprint('rank', os.environ['RANK'], sys.argv[1:])\n")
    run = subprocess.run([sys.executable, "-m", "sdp_jupyter.cli", "--nodes", "2", "--backend", "gloo",
                          "--ranks-output", "all", "--name", "cli", str(ok), "--epochs", "2"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr
    assert "[rank 0] rank 0 ['--epochs', '2']" in run.stdout and "[rank 1] rank 1" in run.stdout
    assert "succeeded" in run.stderr
    bad = write(tmp_path / "bad.py", "raise SystemExit(5)\n")
    run = subprocess.run([sys.executable, "-m", "sdp_jupyter.cli", "--backend", "gloo", str(bad)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and "exited with code 5" in run.stderr
    run = subprocess.run([sys.executable, "-m", "sdp_jupyter.cli", "--nodes", "0", "--name", "never", str(ok)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--nodes: must be 1 or more" in run.stderr
    assert not (jobs_dir / "never").exists()


def test_restarts_run_out_and_the_job_fails(tmp_path, jobs_dir):
    script = write(tmp_path / "always_fails.py", """
        import os, sys
        print("attempt", os.environ["SDP_RESTART"], "rank", os.environ["RANK"])
        sys.exit(2 if os.environ["RANK"] == "1" else 0)
    """)
    job = launch(script, nodes=2, backend="gloo", max_restarts=2, name="runs-out")
    assert job.wait(120) == "failed"
    assert job.restarts == 2 and len(job.status["restart_errors"]) == 2
    assert job.error.startswith("rank 1 (node 1, local rank 0) exited with code 2")
    log = job.logs(1)
    assert [line for line in log.splitlines() if line.startswith("attempt")] == \
        ["attempt 0 rank 1", "attempt 1 rank 1", "attempt 2 rank 1"]
    assert "[sdp_jupyter] restart 2 of 2 after: rank 1" in log


CRASH_IN_A_COLLECTIVE = """
import ctypes, os, threading, time
import torch, torch.distributed as dist
dist.init_process_group("smddp")
if dist.get_rank() == 1:
    # rank 1's main thread waits in all_reduce (rank 0 is late) when another thread of it crashes
    threading.Thread(target=lambda: (time.sleep(1.0), ctypes.string_at(0)), daemon=True).start()
else:
    time.sleep(30)
dist.all_reduce(torch.ones(4))
"""


def test_a_crashed_rank_names_its_collective_and_leaves_its_stacks(tmp_path, jobs_dir):
    """A rank killed by a signal is never silent: its log holds the crashing thread's native frames
    and every thread's Python stack, and the job's error names the collective and the log."""
    job = launch(write(tmp_path / "crash.py", CRASH_IN_A_COLLECTIVE), nodes=2, backend="smddp", name="segv")
    assert job.wait(120) == "failed", job.summary()
    assert job.error.startswith("rank 1 (node 1, local rank 0) was killed by signal SIGSEGV"), job.error
    assert "during torch.distributed.all_reduce" in job.error, job.error
    assert str(job.dir / "logs" / "rank-1.log") in job.error and "sdp_jupyter.doctor" in job.error
    log = job.logs(1)
    assert "[sdp_jupyter] fatal signal 11 (SIGSEGV) in thread" in log and "_engine" in log, log[-3000:]
    assert "Fatal Python error: Segmentation fault" in log and "in all_reduce" in log, log[-3000:]
