"""Warm starts (launch/host/warm.py): forked ranks behave as cold-started ones."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from sdp_jupyter.launch import JobSpec, LocalLauncher
from sdp_jupyter.launch.host import warm
from sdp_jupyter.launch.kernel import warm_pool

pytestmark = pytest.mark.slow

TRAIN = """
    import os, torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    for _ in range(20):
        x = torch.randn(64, 16, generator=g)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)).backward()
        opt.step()
    {k: v.clone() for k, v in model.module.state_dict().items()}
"""


def write(path, text):
    path.write_text(textwrap.dedent(text))
    return str(path)


def run(script, warm_start, nodes=2, **kw):
    job = LocalLauncher(sigint_grace=1.0, sigterm_grace=1.0, warm=warm_start).start(
        JobSpec(script=script, nodes=nodes, backend="gloo", **kw))
    return job


@pytest.fixture(scope="module")
def pool():
    p = warm_pool.warm_up()
    assert p.ready() is None, p.ready()
    yield p
    warm_pool.shutdown()


def test_warm_and_cold_give_bit_identical_parameters(tmp_path, jobs_dir, pool):
    script = write(tmp_path / "train.py", TRAIN)
    cold = run(script, False, result=True)
    assert cold.wait(120) == "succeeded", cold.summary()
    hot = run(script, True, result=True)
    assert hot.wait(120) == "succeeded", hot.summary()
    assert (cold.status["start"], hot.status["start"]) == ("cold", "warm")
    a, b = cold.result(), hot.result()
    assert a.keys() == b.keys() and all(bool((a[k] == b[k]).all()) for k in a)


def test_nothing_leaks_from_one_job_to_the_next(tmp_path, jobs_dir, pool):
    first = write(tmp_path / "first.py", """
        import os, sys, wave
        os.environ["LEAKY"] = "1"
        sys.modules["made_up_by_job"] = wave
        [os.getpid(), os.getsid(0), os.getcwd(), sys.argv[1:]]
    """)
    second = write(tmp_path / "second.py", """
        import os, sys
        {"wave": "wave" in sys.modules, "made": "made_up_by_job" in sys.modules,
         "leaky": "LEAKY" in os.environ, "torch": "torch" in sys.modules,
         "rank": os.environ["RANK"], "argv": sys.argv[1:], "main": __name__,
         "threads": sys.modules["torch"].get_num_threads() == int(os.environ["OMP_NUM_THREADS"])}
    """)
    a = run(first, True, result=True, args=["--x", "1"])
    assert a.wait(60) == "succeeded", a.summary()
    pid, sid, cwd, argv = a.result()
    assert pid == sid == a.status["pids"][0]  # its own session, and the pid the launcher holds
    assert argv == ["--x", "1"] and cwd == os.getcwd()
    b = run(second, True, result=True)
    assert b.wait(60) == "succeeded", b.summary()
    assert b.status["start"] == "warm"
    assert b.result() == {"wave": False, "made": False, "leaky": False, "torch": True,
                          "rank": "0", "argv": [], "main": "__main__", "threads": True}
    assert pool.alive()


def test_pytorchs_tutorial_ending_does_not_hang_a_warm_gloo_job(tmp_path, jobs_dir, pool):
    """destroy_process_group(), then the DDP model going out of scope: with torch._dynamo imported before
    the model was made, torch's gloo process group can deadlock in its destructor (docs/warm.md). The pool
    preloaded torch._dynamo until 2026-11-29 and 3 of 14 such warm jobs hung; it must stay out of the
    pool (checked in the rank, before its optimizer imports it), and three jobs in a row end."""
    script = write(tmp_path / "tutorial.py", """
        import sys, torch, torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP
        preloaded = "torch._dynamo" in sys.modules
        def main():
            dist.init_process_group("gloo")
            model = DDP(torch.nn.Linear(10, 10))
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(5):
                opt.zero_grad(); model(torch.randn(4, 10)).sum().backward(); opt.step()
            dist.destroy_process_group()
        main()
        preloaded
    """)
    for _ in range(3):
        job = run(script, True, result=True)
        assert job.wait(60) == "succeeded", job.summary()
        assert job.status["start"] == "warm" and job.result() is False


def test_failure_naming_and_stop(tmp_path, jobs_dir, pool):
    fail = write(tmp_path / "fail.py", """
        import os, sys, time
        if os.environ["RANK"] == "1":
            print("about to fail", flush=True)
            sys.exit(3)
        time.sleep(120)
    """)
    job = run(fail, True)
    assert job.wait(60) == "failed"
    assert job.status["start"] == "warm"
    assert job.error.startswith("rank 1 (node 1, local rank 0) exited with code 3"), job.error
    assert "about to fail" in job.error
    assert job.exit_codes == [-signal.SIGINT, 3]

    crash = write(tmp_path / "crash.py", "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    job = run(crash, True, nodes=1)
    assert job.wait(60) == "failed" and "killed by signal SIGKILL" in job.error
    assert pool.alive()  # a crashing job never harms the pool

    sleepy = write(tmp_path / "sleepy.py", "import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    job = run(sleepy, True)
    deadline = time.monotonic() + 60
    while "up" not in job.logs(1) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = job.status["pids"]
    # the per-node sampler finds warm ranks (their /proc environ is the pool's: it reads status.json)
    found = 0
    while not found and time.monotonic() < deadline:
        for line in (job.dir / "metrics" / "system-node-1.jsonl").read_text().splitlines() \
                if (job.dir / "metrics" / "system-node-1.jsonl").exists() else []:
            found = max(found, json.loads(line).get("nproc", 0))
        time.sleep(0.2)
    assert found >= 1
    assert job.stop() == "stopped"
    assert job.exit_codes == [-signal.SIGINT, -signal.SIGINT]
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


OWNER = """
import json, sys, time
from sdp_jupyter.launch import JobSpec, LocalLauncher
from sdp_jupyter.launch.host import warm
from sdp_jupyter.launch.kernel import warm_pool
pool = warm_pool.warm_up()
assert pool.ready() is None, pool.ready()
job = LocalLauncher(warm=True).start(JobSpec(script=sys.argv[1], nodes=2, backend="gloo"))
while "up" not in job.logs(1):
    time.sleep(0.1)
print(json.dumps({"pool": pool.proc.pid, "socket": pool.path, "ranks": job.status["pids"], "start": job.status["start"]}),
      flush=True)
time.sleep(300)
"""


def test_killing_the_owner_leaves_neither_pool_nor_rank_nor_socket(tmp_path, jobs_dir):
    sleepy = write(tmp_path / "sleepy.py", "import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    owner = subprocess.Popen([sys.executable, "-c", OWNER, sleepy], stdout=subprocess.PIPE, text=True)
    info = json.loads(owner.stdout.readline())
    assert info["start"] == "warm"
    pids = [info["pool"]] + info["ranks"]
    assert all(psutil.pid_exists(p) for p in pids)
    assert os.path.exists(info["socket"])
    owner.kill()  # the kernel dies
    owner.wait(30)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        left = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not left:
            break
        time.sleep(0.2)
    assert left == []
    assert not os.path.exists(os.path.dirname(info["socket"]))  # the server removed its folder as it went


def test_unsafe_pool_falls_back_to_cold_with_a_reason(monkeypatch):
    import threading

    t = threading.Thread(target=time.sleep, args=(0.5,))
    t.start()
    try:
        assert "threads" in warm.fork_unsafe_reason()
    finally:
        t.join()
    p = warm_pool.Pool.__new__(warm_pool.Pool)
    assert p.start(["/bin/sh", "-c", "true"], {}) == "only `python [-u] -m MODULE` starts warm"


def test_stale_socket_folders_of_killed_servers_are_removed(tmp_path):
    """A server killed outright (Ray SIGKILLs an actor's children) leaves its folder; the next server
    started on that host removes it, but never a live server's nor one still starting."""
    import socket as socketlib

    old = time.time() - 2 * warm.READY_TIMEOUT

    def folder(name, listening, age=old):
        d = tmp_path / (warm.FOLDER_PREFIX + name)
        d.mkdir()
        s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_SEQPACKET)
        s.bind(str(d / "pool.sock"))
        if listening:
            s.listen(1)
        else:
            s.close()
        os.utime(d / "pool.sock", (age, age), follow_symlinks=False)
        os.utime(d, (age, age))
        return d, s

    dead, _ = folder("dead", False)
    empty = tmp_path / (warm.FOLDER_PREFIX + "empty")
    empty.mkdir()
    os.utime(empty, (old, old))
    live, server = folder("live", True)
    starting = tmp_path / (warm.FOLDER_PREFIX + "starting")
    starting.mkdir()  # made just now: its server is importing torch and binds later
    other = tmp_path / "not-a-pool"
    other.mkdir()
    os.utime(other, (old, old))
    try:
        assert sorted(warm.remove_stale_folders(str(tmp_path))) == sorted([str(dead), str(empty)])
        assert not dead.exists() and not empty.exists()
        assert (live / "pool.sock").exists() and starting.exists() and other.exists()
    finally:
        server.close()


def test_an_smddp_job_forks_with_dynamo_and_a_gloo_job_on_that_pool_starts_cold(tmp_path, jobs_dir, pool):
    """torch._dynamo (an optimizer's first step() imports it: most of the quickstart's warm cell) is in the
    pool for smddp jobs; a gloo job on such a pool starts cold, saying why (the tutorial ending above)."""
    script = write(tmp_path / "which.py", """
        import sys
        "torch._dynamo" in sys.modules
    """)
    job = LocalLauncher(warm=True).start(JobSpec(script=script, nodes=1, backend="smddp", result=True))
    assert job.wait(180) == "succeeded", job.summary()
    assert job.status["start"] == "warm" and job.result() is True
    job = run(script, True, nodes=1, result=True)  # gloo
    assert job.wait(120) == "succeeded", job.summary()
    assert job.status["start"] == "cold" and job.result() is False
    assert "preloaded torch._dynamo for its smddp jobs" in job.status["start_reason"], job.status
    warm_pool.shutdown()  # the next pool imports what its jobs name again: no torch._dynamo for gloo
    job = run(script, True, nodes=1, result=True)
    assert job.wait(180) == "succeeded" and job.status["start"] == "warm" and job.result() is False
