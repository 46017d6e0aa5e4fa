"""Cold vs warm start-to-result of the quickstart's training job, for 1, 2 and 4 nodes.

    PYTHONPATH=. python benchmarks/startup.py [--nodes 1,2,4] [--repeats 2] [--json out.json]

Each figure is wall time from LocalLauncher.start() to the result (the trained weights) back in this
process, as `%%sdp_train ... --result weights --wait` measures it. "cold": every rank a fresh
interpreter (`python -m sdp_jupyter.launch.rank.worker`). "warm": ranks forked by the warm pool
(sdp_jupyter/launch/host/warm.py), whose own start-up is printed once and is not part of a warm figure
(a kernel pays it once, after its first job). ipyparallel's 2-engine start-to-result (cluster start,
engines import torch, one result back; then a second call on the running engines) is printed in the
same run for reference when ipyparallel is installed. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

TRAIN = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
import sdp_jupyter
from sdp_jupyter.torch import DistributedDataParallel

dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
model = DistributedDataParallel(net, batch_size=32)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
n = len(X_train) // world * world
X = torch.from_numpy(X_train[:n][rank::world])
Y = torch.from_numpy(y_train[:n][rank::world]).long()
import time
t0 = time.perf_counter()
for epoch in range(EPOCHS):
    order = torch.randperm(len(X), generator=torch.Generator().manual_seed(epoch * world + rank))
    for i in range(0, len(X), 32):
        idx = order[i:i + 32]
        loss = F.cross_entropy(model(X[idx]), Y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    sdp_jupyter.report(step=epoch, samples=len(X), loss=loss.item())
dist.destroy_process_group()
{"weights": {k: v.numpy() for k, v in net.state_dict().items()}, "train_s": time.perf_counter() - t0}
"""


def data():
    import numpy as np
    from sklearn.datasets import load_digits

    X, y = load_digits(return_X_y=True)
    return {"X_train": (X[:1347] / 16.0).astype(np.float32), "y_train": y[:1347]}


def one_job(script: str, nodes: int, warm: bool, push: dict) -> tuple[float, float]:
    """(start-to-result, of which rank 0's training loop) in seconds."""
    from sdp_jupyter.launch import JobSpec, LocalLauncher

    t0 = time.perf_counter()
    job = LocalLauncher(warm=warm).start(
        JobSpec(script=script, nodes=nodes, backend="smddp", push=list(push), result="weights"), push=push)
    state = job.wait(600)
    result = job.result() if state == "succeeded" else None
    dt = time.perf_counter() - t0
    if result is None:
        raise SystemExit(f"{nodes}-node {'warm' if warm else 'cold'} job {state}: {job.error}")
    if job.status.get("start") != ("warm" if warm else "cold"):
        raise SystemExit(f"asked for {'warm' if warm else 'cold'}, got {job.status.get('start')}: "
                         f"{job.status.get('start_reason')}")
    return dt, result["train_s"]


def ipyparallel_figures() -> dict:
    try:
        import ipyparallel as ipp
    except ImportError:
        return {"ipyparallel": "not installed (pip install ipyparallel to include it)"}

    def work():
        import torch
        import torch.optim  # noqa: F401  what the quickstart imports

        return float(torch.ones(4).sum())

    t0 = time.perf_counter()
    cluster = ipp.Cluster(n=2, log_level=40)
    rc = cluster.start_and_connect_sync(activate=False)
    try:
        rc.wait_for_engines(2, timeout=120)
        rc[:].apply_sync(work)
        first = time.perf_counter() - t0
        t1 = time.perf_counter()
        rc[:].apply_sync(work)
        again = time.perf_counter() - t1
    finally:
        rc.close()
        cluster.stop_cluster_sync()
    return {"ipyparallel 2 engines: cluster start to result": round(first, 2),
            "ipyparallel 2 engines: next call": round(again, 3)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="1,2,4")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--json")
    a = p.parse_args()
    os.environ.setdefault("SDP_JOBS_DIR", tempfile.mkdtemp(prefix="sdp-startup-"))
    from sdp_jupyter.launch.kernel import warm_pool

    script = os.path.join(tempfile.mkdtemp(prefix="sdp-startup-"), "train.py")
    with open(script, "w") as f:
        f.write(TRAIN.replace("EPOCHS", str(a.epochs)))
    push = data()
    out = {"load (1 min)": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(), "epochs": a.epochs}
    t0 = time.perf_counter()
    pool = warm_pool.warm_up()
    reason = pool.ready()
    out["warm pool start-up (once per kernel)"] = round(time.perf_counter() - t0, 2)
    if reason:
        raise SystemExit(f"the warm pool cannot fork: {reason}")
    for nodes in [int(n) for n in a.nodes.split(",")]:
        cold = [one_job(script, nodes, False, push) for _ in range(a.repeats)]
        hot = [one_job(script, nodes, True, push) for _ in range(a.repeats)]
        for name, runs in (("cold", cold), ("warm", hot)):
            out[f"{nodes} node(s) {name}: start-to-result, s"] = [round(t, 2) for t, _ in runs]
            out[f"{nodes} node(s) {name}: of which training loop, s"] = [round(x, 2) for _, x in runs]
        c, w = min(t for t, _ in cold), min(t for t, _ in hot)
        print(f"{nodes} node(s): cold {c:.2f} s, warm {w:.2f} s (x{c / w:.1f}); "
              f"start + end overhead: cold {min(t - x for t, x in cold):.2f} s, "
              f"warm {min(t - x for t, x in hot):.2f} s", flush=True)
    warm_pool.shutdown()
    out.update(ipyparallel_figures())
    out["load after (1 min)"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
