"""Preemption: SIGTERM to one node's rank (a spot reclaim, a Slurm preemption) at a random moment of a
training run. With `sdp_jupyter.checkpoint.on_preemption` the ranks agree at the next step boundary,
rank 0 saves (though it was not the one told), everyone leaves, `--max-restarts` starts the job again
and it resumes from that step: no step is lost and none is counted twice. Without a boundary in time,
the grace period ends the rank anyway."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

STEPS = 300

TRAIN = f'''
import os, time, torch, torch.distributed as dist
from sdp_jupyter import checkpoint
dist.init_process_group("smddp")
rank, attempt = dist.get_rank(), int(os.environ["SDP_RESTART"])
state = checkpoint.load() or {{"step": 0, "w": torch.zeros(4)}}
w, start = state["w"], state["step"]
step = start
checkpoint.on_preemption(lambda: checkpoint.save({{"step": step + 1, "w": w}}))
print(f"attempt {{attempt}} resumes at step {{start}}", flush=True)
for step in range(start, {STEPS}):
    g = torch.ones(4)
    dist.all_reduce(g)
    w += g  # each step adds the world size: {STEPS} steps on 2 ranks end at {2 * STEPS}
    if step == start + 3 and rank == 1:
        open(os.path.join(os.environ["SDP_JOB_DIR"], f"training-{{attempt}}"), "w").close()
    time.sleep(0.005)
    checkpoint.step_boundary()
print("final", w.tolist(), flush=True)
'''


def test_sigterm_to_one_node_saves_at_the_next_step_and_the_restarted_job_resumes_there(jobs_dir):
    from sdp_jupyter.launch import launch

    job = launch(code=TRAIN, nodes=2, backend="smddp", name="preempted", max_restarts=1)
    marker = job.dir / "training-0"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert time.monotonic() < deadline and not job.done, job.error
        time.sleep(0.05)
    time.sleep(random.uniform(0.0, 0.8))  # a random moment of the run
    os.kill(job.status["pids"][1], signal.SIGTERM)  # node 1's rank, not rank 0: it must still save
    assert job.wait(180) == "succeeded", job.error
    log0 = job.logs(0)
    assert "attempt 0 resumes at step 0" in log0, log0[-2000:]
    resumed = [ln for ln in log0.splitlines() if ln.startswith("attempt 1 resumes at step ")]
    assert resumed and int(resumed[0].split()[-1]) > 3, log0[-2000:]  # from the preemption checkpoint
    assert f"final {[float(2 * STEPS)] * 4}" in log0, log0[-2000:]  # no step lost, none counted twice
    assert "SIGTERM (preemption?)" in job.logs(1) and "the preemption hooks ran" in log0


def test_a_rank_that_reaches_no_boundary_leaves_when_the_grace_period_ends(tmp_path):
    script = tmp_path / "stuck.py"
    script.write_text("import time\nfrom sdp_jupyter import checkpoint\n"
                      "checkpoint.on_preemption(lambda: print('hook ran', flush=True))\n"
                      "print('ready', flush=True)\ntime.sleep(60)\n")
    env = {**os.environ, "SDP_PREEMPT_GRACE_S": "0.5"}
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=20)[0]
    finally:
        p.kill()
    assert p.returncode == -signal.SIGTERM and time.monotonic() - t0 < 10, (p.returncode, out)
    assert "no step boundary within 0.5 s" in out and "hook ran" not in out, out
