"""Training steps/s: stock DDP on gloo, stock DDP on smddp, and our wrapper on smddp, same run.

    python benchmarks/ddp.py                          # both models, 2 ranks (1 node), 20 timed steps
    python benchmarks/ddp.py --models mlp25m --steps 10 --nodes 2
    python benchmarks/ddp.py --fusion-sweep           # our wrapper at several SDP_FUSION_THRESHOLD values

Prints steps/s per mode, the ratio to stock DDP+gloo, and for our wrapper the share of
communication left exposed after overlap (exposed / total communication time). JSON goes to
benchmarks/results/ddp.json (or ddp_fusion.json for the sweep).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MODES = ["ddp-gloo", "ddp-smddp", "ours-smddp"]


def worker(model_name: str, mode: str, steps: int, warmup: int, fusion: int | None) -> None:
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch as sdt
    from models import make

    torch.set_num_threads(1)
    dist.init_process_group("gloo" if mode == "ddp-gloo" else "smddp")
    torch.manual_seed(0)
    model, loss_fn, batch = make(model_name)
    if mode == "ours-smddp":
        ddp = sdt.DistributedDataParallel(model, fusion_threshold=fusion, report_metrics=False)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    exposed, comm, step_times = [], [], []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        ts = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        loss_fn(ddp).backward()
        opt.step()
        if i >= warmup:
            step_times.append(time.perf_counter() - ts)
            if mode == "ours-smddp":
                exposed.append(ddp.last_step["exposed_comm"])
                comm.append(ddp.last_step["comm_time"])
    dist.barrier()
    elapsed = time.perf_counter() - t0
    out = {"rank": dist.get_rank(), "steps_per_s": steps / elapsed, "mean_step_s": sum(step_times) / len(step_times)}
    if comm:
        out["exposed_comm_s"] = sum(exposed) / len(exposed)
        out["comm_s"] = sum(comm) / len(comm)
    dist.destroy_process_group()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default="mlp25m")
    ap.add_argument("--mode", default="ours-smddp")
    ap.add_argument("--models", default="mlp25m,transformer")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=1, help="lay the ranks out as this many nodes")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--fusion", type=int, default=0, help="fusion threshold for our wrapper (0: default)")
    ap.add_argument("--fusion-sweep", action="store_true")
    ap.add_argument("--fusion-values", default="1,4,8,16,32,128",
                    help="MiB values the sweep tries, in this order (repeat or reverse them to average out drift)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.worker:
        worker(a.model, a.mode, a.steps, a.warmup, a.fusion or None)
        return
    from _spawn import machine_info, run_ranks, write_results

    per_node = max(1, a.ranks // a.nodes)
    info = machine_info()
    print(f"machine: {info['cpus']} cpus, load {info['loadavg_1min']}; {a.ranks} ranks as {a.nodes} node(s)", flush=True)
    rows = []
    if a.fusion_sweep:
        for model in a.models.split(","):
            for fusion in [int(float(v) * (1 << 20)) for v in a.fusion_values.split(",")]:
                out = run_ranks(os.path.abspath(__file__), a.ranks, per_node,
                                ["--model", model, "--mode", "ours-smddp", "--steps", str(a.steps),
                                 "--warmup", str(a.warmup), "--fusion", str(fusion)])
                sps = min(o["steps_per_s"] for o in out)
                exp = max(o["exposed_comm_s"] for o in out) / max(o["comm_s"] for o in out)
                rows.append({"model": model, "fusion_bytes": fusion, "steps_per_s": sps, "exposed_fraction": exp})
                print(f"{model:12s} fusion {fusion / (1 << 20):5g} MiB: {sps:6.2f} steps/s, exposed {100 * exp:4.0f}% of comm",
                      flush=True)
        out_path = a.out or os.path.join(HERE, "results", "ddp_fusion.json")
    else:
        for model in a.models.split(","):
            res = {}
            for mode in MODES:
                out = run_ranks(os.path.abspath(__file__), a.ranks, per_node,
                                ["--model", model, "--mode", mode, "--steps", str(a.steps), "--warmup", str(a.warmup)]
                                + (["--fusion", str(a.fusion)] if a.fusion else []))
                res[mode] = {"steps_per_s": min(o["steps_per_s"] for o in out)}
                if mode == "ours-smddp":
                    res[mode]["exposed_fraction"] = (max(o["exposed_comm_s"] for o in out)
                                                     / max(o["comm_s"] for o in out))
            base = res["ddp-gloo"]["steps_per_s"]
            for mode in MODES:
                row = {"model": model, "mode": mode, **res[mode], "ratio_vs_ddp_gloo": res[mode]["steps_per_s"] / base}
                rows.append(row)
                extra = f", exposed {100 * row['exposed_fraction']:.0f}% of comm" if "exposed_fraction" in row else ""
                print(f"{model:12s} {mode:11s} {row['steps_per_s']:7.2f} steps/s  x{row['ratio_vs_ddp_gloo']:.2f} vs DDP+gloo{extra}",
                      flush=True)
        out_path = a.out or os.path.join(HERE, "results", "ddp.json")
    write_results(out_path, info, rows, ranks=a.ranks, nodes=a.nodes)


if __name__ == "__main__":
    main()
