"""smddp under torchrun's own elastic agent, a worker SIGKILLed again and again: does every restarted
worker group make its process group again and end with the weights of a run that never failed? gloo
is the peer, with the same kills, in the same run.

    PYTHONPATH=. python benchmarks/torchrun_stress.py [--kills 5] [--steps 300] [--seed 0]
                                                      [--out results/torchrun_stress.json]

Per backend: one clean run, then one run of `torchrun --standalone --nproc-per-node 4 --max-restarts
KILLS+1` (c10d rendezvous: every attempt gets the same store) in which, --kills times, once the group
trains (rank 0 has written a step after the last kill), a random rank's process is SIGKILLed 0-0.3 s
later. The script saves a checkpoint (weights, momentum, step) on rank 0 after every step by an atomic
rename, and resumes from it; its data depends only on the step and the rank, so a run that restarts
must end with exactly the clean run's weights. "back" is from a kill until rank 0 writes a step of the
next attempt. After each run: shared memory segments named /dev/shm/sdp-* and one-host secret files
left behind are counted. Not a test: nothing is asserted.
"""
from __future__ import annotations

import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _spawn import bench_parser, machine_info, read_text as _read, write_results  # noqa: E402

SCRIPT = r'''
import hashlib, os, sys, time, torch, torch.distributed as dist
backend, ck, steps, pids = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
if backend == "smddp":
    import sdp_jupyter.torch  # noqa: F401
dist.init_process_group(backend)
rank, world = dist.get_rank(), dist.get_world_size()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with open(f"{pids}/rank-{rank}.tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(f"{pids}/rank-{rank}.tmp", f"{pids}/rank-{rank}")
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
model = torch.nn.parallel.DistributedDataParallel(net)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
start = 0
if os.path.exists(ck):
    state = torch.load(ck)
    net.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
for step in range(start, steps):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 32, generator=g); y = x[:, :1] * 2 - x[:, 1:2]
    opt.zero_grad(); torch.nn.functional.mse_loss(model(x), y).backward(); opt.step()
    if rank == 0:
        torch.save({"model": net.state_dict(), "opt": opt.state_dict(), "step": step + 1}, ck + ".tmp")
        os.replace(ck + ".tmp", ck)
        with open(f"{pids}/step.tmp", "w") as f:
            f.write(f"{attempt} {step}")
        os.replace(f"{pids}/step.tmp", f"{pids}/step")
    time.sleep(0.02)
if rank == 0:
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()[:16]
    print("WEIGHTS", attempt, digest, flush=True)
dist.destroy_process_group()
'''

WEIGHTS = re.compile(r"^WEIGHTS (\d+) (\w+)$", re.M)


def _ours() -> set[str]:
    """smddp's shared memory segments and one-host secret files on this host now."""
    from sdp_jupyter.comm.secret import user_dir

    try:
        secrets = {f"secret:{n}" for n in os.listdir(user_dir()) if n.startswith("secret-")}
    except OSError:
        secrets = set()
    return {n for n in os.listdir("/dev/shm") if n.startswith("sdp-")} | secrets


def _leftovers(before: set[str]) -> dict:
    """What a run left that was not there before it (another job's files are not counted)."""
    new = _ours() - before
    return {"shm": sorted(n for n in new if n.startswith("sdp-")),
            "secret_files": sum(n.startswith("secret:") for n in new)}


def one_run(backend: str, kills: int, steps: int, rng: random.Random, work: str, name: str,
            deadline: float = 300.0) -> dict:
    pids = os.path.join(work, name)
    os.makedirs(pids)
    ck = os.path.join(pids, "ck.pt")
    script = os.path.join(work, "train.py")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                            "SDP_JOB_SECRET", "SDP_BACKEND")}
    before = _ours()
    t0 = time.monotonic()
    log = open(os.path.join(pids, "torchrun.log"), "w")
    p = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                          "--nproc-per-node", "4", "--max-restarts", str(kills + 1), script, backend, ck, str(steps),
                          pids], env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    events = []
    last_attempt = -1
    for k in range(kills):
        # once the current attempt trains (a step of an attempt after the last kill's)
        at = None
        while p.poll() is None:
            at = _read(os.path.join(pids, "step"))
            if at and int(at.split()[0]) > last_attempt:
                break
            time.sleep(0.005)
        if p.poll() is not None:
            break
        attempt, step = map(int, at.split())
        if step > steps - 20:  # too near the end for one more kill
            break
        time.sleep(rng.uniform(0.0, 0.3))
        victim = rng.randrange(4)
        pid = int(_read(os.path.join(pids, f"rank-{victim}")) or 0)
        killed = time.monotonic()
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, OSError):
            continue
        last_attempt = attempt
        while p.poll() is None:  # the next attempt's first step
            at = _read(os.path.join(pids, "step"))
            if at and int(at.split()[0]) > attempt:
                break
            time.sleep(0.005)
        events.append({"kill": k, "rank": victim, "attempt": attempt, "at_step": step,
                       "back_s": round(time.monotonic() - killed, 3) if p.poll() is None else None})
    try:
        code = p.wait(timeout=deadline)
    except subprocess.TimeoutExpired:  # counted as a hang; the agent stops its workers on SIGTERM
        p.terminate()
        code = p.wait(timeout=60)
        events.append({"hang": f"torchrun had not ended {deadline:g} s after the start"})
    log.close()
    text = _read(log.name) or ""
    weights = WEIGHTS.findall(text)
    return {"backend": backend, "run": name, "code": code, "wall_s": round(time.monotonic() - t0, 2),
            "kills": events, "weights": weights[-1][1] if weights else None,
            "attempts": int(weights[-1][0]) + 1 if weights else None, **_leftovers(before),
            "tail": text[-1500:] if code != 0 or not weights else ""}


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--backends", default="smddp,gloo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "torchrun_stress.json"))
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="sdp-torchrun-stress-")
    with open(os.path.join(work, "train.py"), "w") as f:
        f.write(SCRIPT)
    rows = []
    for backend in a.backends.split(","):
        clean = one_run(backend, 0, a.steps, rng, work, f"{backend}-clean")
        killed = one_run(backend, a.kills, a.steps, rng, work, f"{backend}-killed")
        killed["same_weights_as_clean"] = killed["weights"] is not None and killed["weights"] == clean["weights"]
        rows += [clean, killed]
        for r in (clean, killed):
            print(f"{backend:6s} {r['run']:14s} exit {r['code']} in {r['wall_s']:.1f} s, {len(r['kills'])} kills, "
                  f"{r['attempts']} attempts, weights {r['weights']}, shm left {len(r['shm'])}, "
                  f"secret files {r['secret_files']}" + (f"\n{r['tail']}" if r["tail"] else ""), flush=True)
    print(f"\n{'backend':8s} {'kills':>5s} {'back p50 s':>10s} {'back max s':>10s} {'lost s':>7s} {'same weights':>12s}"
          f" {'exit':>4s} {'shm left':>8s}")
    summary = {}
    for backend in a.backends.split(","):
        clean, killed = [r for r in rows if r["backend"] == backend]
        back = [e["back_s"] for e in killed["kills"] if e.get("back_s") is not None]
        lost = killed["wall_s"] - clean["wall_s"]
        summary[backend] = {"back_p50_s": statistics.median(back) if back else None, "lost_s": round(lost, 2),
                            "same_weights": killed["same_weights_as_clean"]}
        print(f"{backend:8s} {len(killed['kills']):5d} {statistics.median(back) if back else float('nan'):10.2f} "
              f"{max(back, default=float('nan')):10.2f} {lost:7.1f} {str(killed['same_weights_as_clean']):>12s}"
              f" {killed['code']:4d} {len(killed['shm']):8d}")
    if summary.get("smddp", {}).get("back_p50_s") and summary.get("gloo", {}).get("back_p50_s"):
        print(f"back to training after a kill: gloo / smddp = "
              f"{summary['gloo']['back_p50_s'] / summary['smddp']['back_p50_s']:.2f}")
    write_results(a.out, machine_info(), rows, kills=a.kills, steps=a.steps, seed=a.seed, summary=summary)


if __name__ == "__main__":
    main()
