"""What the remote-target tests (SSH, Ray) run: a seeded training script, and a driver that plays the
notebook on test host h0 (it calls sdp_jupyter.launch exactly as a cell would) and reports in JSON lines."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent

# One data-parallel step of the scripts below (x, y: this rank's batch)
_STEP = """    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
    opt.step()
"""

# Seeded: the same job gives the same parameters on any target. STEPS / STEP_SLEEP make it long.
TRAIN = r'''
import os, socket, time, torch, torch.distributed as dist
dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Tanh(), torch.nn.Linear(512, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
g = torch.Generator().manual_seed(100 + rank)
for step in range(int(os.environ.get("STEPS", "6"))):
    x, y = torch.randn(16, 256, generator=g), torch.randn(16, 8, generator=g)
STEP
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
names = [None] * world
dist.all_gather_object(names, (socket.gethostname(), os.environ["SDP_BIND_ADDR"]))
{"hosts": names, "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}
'''.replace("STEP\n", _STEP)

# A checkpointed script (elastic jobs, restarts): it resumes from its checkpoint, saved every step, and
# says with how many ranks each attempt starts ("attempt A world W from step S"). STEPS / STEP_SLEEP as
# above; FAIL_AT=S makes the last rank fail in attempt 0 once step S is saved.
ELASTIC_TRAIN = r'''
import os, time, torch, torch.distributed as dist
from sdp_jupyter import checkpoint
dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
state = checkpoint.load()  # after init_process_group: every rank gets node 0's copy
start = 0
if state:
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"] + 1
print(f"attempt {os.environ['SDP_RESTART']} world {world} from step {start}", flush=True)
for step in range(start, int(os.environ.get("STEPS", "6"))):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 4, generator=g)
STEP
    checkpoint.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()})
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step == int(os.environ.get("FAIL_AT", "-1")) and os.environ["SDP_RESTART"] == "0" and rank == world - 1:
        raise SystemExit(f"rank {rank} fails on purpose in attempt 0 after step {step}")
    time.sleep(float(os.environ.get("STEP_SLEEP", "0")))
{"world": world, "attempt": int(os.environ["SDP_RESTART"])}
'''.replace("STEP\n", _STEP)

# A long job (STEP_SLEEP set) prints {"running"} once rank 0 is at step 2, then reads a command on
# stdin: "stop" stops the job, anything else waits for it. Every job ends with {"state", ...}.
LAUNCH = r'''
import faulthandler, json, signal, sys, time, sdp_jupyter
faulthandler.register(signal.SIGUSR1)  # next_line asks a driver that hangs for its threads' stacks
from sdp_jupyter.launch import SpecError
args = json.loads(sys.argv[1])
t0 = time.time()
try:
    job = sdp_jupyter.launch(**args)
except SpecError as e:
    print(json.dumps({"spec_error": str(e), "option": e.option, "after": time.time() - t0}), flush=True)
    raise SystemExit(0)
'''
DRIVER = LAUNCH + r'''
if args.get("env", {}).get("STEP_SLEEP"):
    while "step 2" not in job.logs(0) and not job.done:
        time.sleep(0.1)
    print(json.dumps({"running": job.name}), flush=True)
    if sys.stdin.readline().strip() == "stop":
        t0 = time.monotonic(); job.stop()
        print(json.dumps({"stopped_in": time.monotonic() - t0}), flush=True)
job.wait()
print(json.dumps({"state": job.state, "error": job.error, "dir": str(job.dir), "t": time.time(),
                  "codes": job.exit_codes, "restarts": job.restarts, "status": job.status,
                  "summary": job.summary()}), flush=True)
'''


def drive(cluster, launch_args: dict, env: dict | None = None, driver: str | None = None) -> subprocess.Popen:
    """Start the driver on h0 with these launch() arguments (code: TRAIN unless given); its stdin stays
    open for commands. `driver`: another driver's code (LAUNCH, then what it does with `job`)."""
    full = dict(env or os.environ)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    proc = cluster.popen(0, [sys.executable, "-c", driver or DRIVER, json.dumps({"code": TRAIN, **launch_args})], env=full,
                         text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.jobs_dir = launch_args.get("jobs_dir")  # what next_line shows of the job when the driver goes quiet
    return proc


# A notebook that runs a function of its own on the ranks (sdp_jupyter.run): its `__main__` is the
# notebook's, so what it defines goes by value. A class reading a notebook global inside; each rank
# returns [rank, host, world, 60]
RUN_FUNCTION = r'''
import json, os, sys, sdp_jupyter
args = json.loads(sys.argv[1])
args.pop("code")  # run() makes the job's code from the function
SCALE = 3
class Net:
    def forward(self, x):
        return x * SCALE
def f(n, scale=1):
    import socket, torch.distributed as dist
    return [int(os.environ["RANK"]), socket.gethostname(), dist.get_world_size(), Net().forward(n) * scale]
print(json.dumps({"values": sdp_jupyter.run(f, args=(10,), kwargs={"scale": 2}, **args)}), flush=True)
'''


def tell(proc, command: str) -> None:
    proc.stdin.write(command + "\n")
    proc.stdin.flush()


def next_line(proc, timeout: float = 120.0) -> dict:
    """The driver's next JSON line (its stderr is shown if it ends first)."""
    # Lines are cut from the pipe's bytes here: a readline() after select() read ahead into the file
    # object's buffer, and a second line that came in the same read waited for more output (a driver
    # that prints two lines and then waits for a command waited forever).
    deadline = time.monotonic() + timeout
    fd = proc.stdout.fileno()
    pending = proc.__dict__.setdefault("_lines_pending", bytearray())
    while time.monotonic() < deadline:
        while b"\n" in pending:
            end = pending.index(b"\n")
            line = bytes(pending[:end]).decode(errors="replace")
            del pending[:end + 1]
            if line.startswith("{"):
                return json.loads(line)
        ready, _, _ = select.select([fd], [], [], 0.5)
        if ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            pending += chunk
    if proc.poll() is None:  # a driver that hangs: its threads' stacks (the drivers register SIGUSR1)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
    proc.kill()
    raise AssertionError(f"the driver said nothing more; its stderr: {proc.stderr.read()[-3000:]}"
                         + _job_record(getattr(proc, "jobs_dir", None)))


def _job_record(jobs_dir) -> str:
    """What the driver's jobs left on disk: each one's status.json and the end of every rank's log."""
    if not jobs_dir or not Path(jobs_dir).is_dir():
        return ""
    from sdp_jupyter import jobdir

    said = []
    for job in sorted(p for p in Path(jobs_dir).iterdir() if p.is_dir()):
        status = job / jobdir.STATUS
        said.append(f"\n--- {job.name}/{jobdir.STATUS}:\n" + (status.read_text()[-3000:] if status.exists() else "(none)"))
        for log in sorted((job / jobdir.LOGS).glob("*.log")):
            said.append(f"\n--- {job.name}/{jobdir.LOGS}/{log.name}:\n" + jobdir.read_log(log, tail=15))
    return "".join(said)


# A notebook's session on h0: jobs [name, start, env] run one after another in one process (so the
# warm pools it holds on the hosts live from one job to the next); each job's outcome is one JSON line.
# A long job (STEP_SLEEP) prints {"running"} first. The driver reads a line on stdin before it exits.
SESSION_DRIVER = r'''
import json, sys, time, sdp_jupyter
args, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, start, env in runs:
    job = sdp_jupyter.launch(**args, name=name, start=start, env=env)
    if env.get("STEP_SLEEP"):
        while "step 2" not in job.logs(0) and not job.done:
            time.sleep(0.1)
        print(json.dumps({"running": name, "status": job.status}), flush=True)
    job.wait()
    result = job.result() if job.state == "succeeded" else None
    print(json.dumps({"name": name, "state": job.state, "error": job.error, "status": job.status,
                      "summary": job.summary(), "params": result and result["params"].tolist()}), flush=True)
sys.stdin.readline()
'''


def drive_session(cluster, launch_args: dict, runs: list, env: dict | None = None) -> subprocess.Popen:
    """Start SESSION_DRIVER on h0 with these launch() arguments (TRAIN as the code) and jobs."""
    full = dict(env or os.environ)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    full.pop("SDP_WARM", None)
    return cluster.popen(0, [sys.executable, "-c", SESSION_DRIVER, json.dumps({"code": TRAIN, **launch_args}),
                             json.dumps(runs)], env=full, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)


# Plays the notebook on h0 with an interactive session (launch/kernel/session.py) on remote hosts: cells
# through the agents, a failure, an interrupt, stop; one JSON line per step.
CELLS_DRIVER = r'''
import faulthandler, json, os, signal, socket, sys, threading
# A notebook kernel takes SIGINT as KeyboardInterrupt even when it was started with SIGINT ignored (as
# from CI's background shell: the ignore is inherited, and Python then installs no handler); so does
# this stand-in, or the interrupt step's SIGINT would do nothing and the cell run forever.
signal.signal(signal.SIGINT, signal.default_int_handler)
faulthandler.register(signal.SIGUSR1, all_threads=True)  # next_line() asks for the stacks of a driver that hangs
from sdp_jupyter.launch import JobSpec
from sdp_jupyter.launch.kernel import session as sessions
args = json.loads(sys.argv[1])
s = sessions.start(JobSpec(code="pass", **args))
say = lambda **kw: print(json.dumps(kw), flush=True)
say(ready=s.status())
r = s.run("import socket, torch, torch.distributed as dist\nt = torch.ones(256) * (dist.get_rank() + 1)\n"
          "dist.all_reduce(t)\n(socket.gethostname(), t[0].item())", want="gather")
say(gather=[r.value(i) for i in range(s.job.world_size)], failed=r.failed, seconds=r.seconds)
r = s.run("if dist.get_rank() == 2:\n    raise RuntimeError('host three is unhappy')\ndist.all_reduce(t)\n")
say(failed=r.failed, message=r.message())
threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
try:
    s.run("import time\nwhile True:\n    time.sleep(0.05)\n")
    say(interrupted=False)
except KeyboardInterrupt:
    say(interrupted=True, message=s.last.message())
r = s.run("t = torch.ones(4)\ndist.all_reduce(t)\nt.sum().item()", want="result")
say(after=r.value(0), failed=r.failed)
# rank 2 dies inside a cell: its agent starts it again, the others keep their variables (socket, from cell 1)
r = s.run("import os, signal\nif dist.get_rank() == 2:\n    os.kill(os.getpid(), signal.SIGKILL)\ndist.all_reduce(t)\n")
say(failed=r.failed, message=r.message())
r = s.run("import torch, torch.distributed as dist\nt = torch.ones(4)\ndist.all_reduce(t)\n"
          "(t.sum().item(), 'socket' in globals(), sdp_replaced)", want="gather")
say(replaced=[r.value(i) for i in range(s.job.world_size)], failed=r.failed, status=s.status()["replacements"],
    message=r.message())
say(stopped=s.stop(), error=s.job.error)
'''


def drive_cells(cluster, launch_args: dict, host_names: list, env: dict | None = None) -> None:
    """Run CELLS_DRIVER on h0 with these JobSpec fields and check each step (N ranks on `host_names`)."""
    full = dict(env or os.environ)
    full["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), full.get("PYTHONPATH")]))
    proc = cluster.popen(0, [sys.executable, "-c", CELLS_DRIVER, json.dumps(launch_args)], env=full, text=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    n = len(host_names)
    try:
        _cells_steps(proc, n, host_names)
    except AssertionError as e:  # what the ranks said, for a step that hung or went wrong
        raise AssertionError(f"{e}\n{_job_logs(launch_args.get('jobs_dir'))}") from None
    finally:
        if proc.poll() is None:
            proc.kill()


def _job_logs(jobs_dir) -> str:
    """The last lines of every rank's log of the jobs under `jobs_dir` (a failed remote test's story)."""
    out = []
    for log in sorted(Path(jobs_dir or "/nonexistent").glob("*/logs/*.log")):
        out.append(f"--- {log.parent.parent.name}/{log.name}:\n" + "".join(log.read_text(errors="replace").splitlines(True)[-12:]))
    return "\n".join(out)[-6000:] or "(no job logs)"


def _cells_steps(proc, n: int, host_names: list) -> None:
    ready = next_line(proc, timeout=180)["ready"]
    assert ready["alive"] and sorted(set(ready["hosts"].values())) == sorted(host_names), ready
    line = next_line(proc)
    total = n * (n + 1) / 2
    assert line["failed"] == [] and [v for _, v in line["gather"]] == [total] * n, line
    assert sorted(h for h, _ in line["gather"]) == sorted(host_names)
    line = next_line(proc)
    assert 2 in line["failed"] and "RuntimeError: host three is unhappy" in line["message"], line
    assert "process group reconnected" in line["message"]
    line = next_line(proc)
    assert line["interrupted"] and f"interrupted on ranks 0-{n - 1}" in line["message"], line
    line = next_line(proc)
    assert line == {"after": 4.0 * n, "failed": []}, line
    line = next_line(proc)
    assert line["message"].startswith("rank 2 died during the cell"), line
    assert "rank 2 was started again and joined the process group: every variable it had is gone" in line["message"]
    line = next_line(proc)
    assert line["failed"] == [] and [v[0] for v in line["replaced"]] == [4.0 * n] * n, line
    assert [(v[1], v[2]) for v in line["replaced"]] == [(r != 2, r == 2) for r in range(n)], line
    assert [x["rank"] for x in line["status"]] == [2] and "SIGKILL" in line["status"][0]["why"], line
    line = next_line(proc)
    assert line["stopped"] == "succeeded", line
    proc.wait(timeout=30)
