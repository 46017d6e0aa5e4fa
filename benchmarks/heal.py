"""A rank killed mid-training: what healing in place (--heal) costs against a checkpoint restart
(--max-restarts), in the same run, on the same 4-rank DDP job.

    PYTHONPATH=. python benchmarks/heal.py [--steps 100] [--kill-at 50] [--out results/heal.json]

Three local smddp jobs of one script (a small MLP on generated data, DDP, a 20 ms pause per step):
  clean     no rank dies: the reference time and final loss (run twice: the run-to-run spread)
  heal      --heal --max-restarts 1: rank 2 SIGKILLs itself in step --kill-at; sdp_jupyter.heal.Healer
  restart   --max-restarts 1: the same death; every rank restarts and resumes from the checkpoint
            rank 0 wrote after each step (sdp_jupyter.checkpoint)
"lost" is a job's wall time (status: started to ended) minus the clean run's. The final loss is the
full-data loss of rank 0's model. Not a test: nothing is asserted.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _spawn import bench_parser, machine_info, write_results  # noqa: E402

SCRIPT = r'''
import os, signal, time
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from sdp_jupyter import checkpoint

MODE, STEPS, KILL_AT = os.environ["MODE"], int(os.environ["STEPS"]), int(os.environ["KILL_AT"])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
g = torch.Generator().manual_seed(1)
X = torch.randn(2048, 16, generator=g); Y = X[:, :1] * 2 - X[:, 1:2] + 0.1 * torch.randn(2048, 1, generator=g)
first = os.environ.get("SDP_RESTART", "0") == "0" and not os.environ.get("SDP_HEAL_JOIN")
PIDS = os.environ.get("PIDS")  # benchmarks/heal_stress.py: where each rank says its pid and step
if PIDS:
    with open(os.path.join(PIDS, "rank-" + os.environ["RANK"]), "w") as f:
        f.write(str(os.getpid()))

def batch(step):
    r, w = dist.get_rank(), dist.get_world_size()
    idx = torch.arange(step * 64 + r, step * 64 + 64, w) % 2048
    return X[idx], Y[idx]

def one(step, ddp):
    if step == KILL_AT and int(os.environ["RANK"]) == 2 and first and MODE != "clean":
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = batch(step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    opt.step()
    if PIDS:
        with open(os.path.join(PIDS, "step-" + os.environ["RANK"]), "w") as f:
            f.write(str(step))
    time.sleep(0.02)

if MODE in ("heal", "clean"):  # clean: the same healer path, no death
    from sdp_jupyter.heal import Healer
    healer = Healer(model, opt, wrap=lambda m: DDP(m))
    for step in healer.steps(STEPS):
        healer.run(lambda: one(step, healer.model))
    healer.close()
else:
    dist.init_process_group("smddp")
    start = 0
    state = checkpoint.load()
    if state is not None:
        model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"]
    ddp = DDP(model)
    for step in range(start, STEPS):
        one(step, ddp)
        checkpoint.save({"step": step + 1, "model": model.state_dict(), "opt": opt.state_dict()})
    dist.destroy_process_group()
if PIDS:  # the same weights on every rank at the end, or the heal went wrong
    print("final", os.environ["RANK"], repr(float(sum(p.double().sum() for p in model.parameters()))), flush=True)
float(torch.nn.functional.mse_loss(model(X), Y))
'''


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--kill-at", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "heal.json"))
    a = ap.parse_args()
    from sdp_jupyter.launch import launch

    work = tempfile.mkdtemp(prefix="sdp-heal-bench-")
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    rows = []
    for mode, extra in (("clean", {"heal": True, "max_restarts": 1}), ("heal", {"heal": True, "max_restarts": 1}),
                        ("restart", {"max_restarts": 1}), ("clean", {"heal": True, "max_restarts": 1})):
        env = {"MODE": mode, "STEPS": str(a.steps), "KILL_AT": str(a.kill_at)}
        t0 = time.time()
        job = launch(script, nodes=4, backend="smddp", env=env, jobs_dir=os.path.join(work, "jobs"),
                     name=f"{mode}-{len(rows)}", **extra)
        state = job.wait(900)
        wall = job.status["ended"] - job.status["started"]
        rows.append({"mode": mode, "state": state, "wall_s": round(wall, 2), "total_s": round(time.time() - t0, 2),
                     "loss": job.result() if state == "succeeded" else None,
                     "changes": len(job.status.get("heals", [])), "restarts": job.status.get("restarts", 0)})
        print(f"... {mode}: {state} in {wall:.1f} s", flush=True)
    clean = min(r["wall_s"] for r in rows if r["mode"] == "clean")
    print(f"\n{'mode':8} {'state':10} {'wall s':>7} {'lost s':>7} {'final loss':>11}")
    for r in rows:
        r["lost_s"] = round(r["wall_s"] - clean, 2)
        loss = f"{r['loss']:.5f}" if r["loss"] is not None else "-"
        print(f"{r['mode']:8} {r['state']:10} {r['wall_s']:7.2f} {r['lost_s']:7.2f} {loss:>11}")
    heal = next(r for r in rows if r["mode"] == "heal")
    restart = next(r for r in rows if r["mode"] == "restart")
    if heal["lost_s"] > 0:
        print(f"\ntime lost: restart / heal = {restart['lost_s'] / heal['lost_s']:.1f}x")
    write_results(a.out, machine_info(), rows, steps=a.steps, kill_at=a.kill_at)


if __name__ == "__main__":
    main()
