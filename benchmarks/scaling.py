"""Scaling simulation: how throughput per rank holds up from 1 to 8 ranks, without more cores.

    python benchmarks/scaling.py                          # 1, 2, 4, 8 ranks; 25M parameters in 12 layers
    python benchmarks/scaling.py --ranks 1,2,4 --params 10e6 --bwd-ms 40 --steps 6

Each rank trains a model whose layers hold real parameters (a real model size, so real gradients
flow through the engine) but whose compute is simulated the way a GPU would do it: the forward of
each layer sleeps fwd-ms and its backward sleeps bwd-ms, leaving the CPU free, then returns a real
gradient tensor. Communication therefore competes only with other communication, as it does on a
GPU cluster, and 8 ranks fit on a 2-core machine.

Modes: our wrapper on smddp (as 1 node and as one rank per node), stock DDP on gloo (gloo has no
notion of nodes: every pair talks TCP). Scaling efficiency = steps/s per rank at N ranks divided
by steps/s of the same mode at 1 rank. Prints a table and writes benchmarks/results/scaling.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def build(params: int, layers: int, fwd_s: float, bwd_s: float):
    from models import sleeping_model

    # layer i's gradient is 1e-3 * (i + 1): every rank's result is checkable
    return sleeping_model([[(params // layers,)]] * layers, fwd_s, bwd_s, lambda i: 1e-3 * (i + 1))


def worker(mode: str, params: int, layers: int, fwd_s: float, bwd_s: float, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch as sdt

    torch.set_num_threads(1)
    dist.init_process_group("gloo" if mode == "ddp-gloo" else "smddp")
    model = build(params, layers, fwd_s, bwd_s)
    if dist.get_world_size() == 1:
        ddp = model  # the 1-rank baseline: no communication at all
    elif mode == "ours-smddp":
        ddp = sdt.DistributedDataParallel(model, report_metrics=False)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
    x = torch.ones(8, 16, requires_grad=True)
    exposed = []
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0 = time.perf_counter()
        for p in model.parameters():
            p.grad = None if p.grad is None else p.grad.zero_()
        ddp(x).sum().backward()
        if i >= warmup and mode == "ours-smddp" and dist.get_world_size() > 1:
            exposed.append(ddp.last_step["exposed_comm"])
    dist.barrier()
    elapsed = time.perf_counter() - t0
    # every rank's gradient is the mean of identical per-rank gradients: check one value
    expect = 1e-3 * layers
    got = float(list(model.parameters())[-1].grad[0])
    out = {"rank": dist.get_rank(), "steps_per_s": steps / elapsed, "grad_ok": abs(got - expect) < 1e-6 * layers}
    if exposed:
        out["exposed_comm_s"] = sum(exposed) / len(exposed)
    dist.destroy_process_group()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ours-smddp")
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--params", type=float, default=25e6, help="parameters of the simulated model (fp32)")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--bwd-ms", type=float, default=60.0, help="simulated backward compute per layer")
    ap.add_argument("--fwd-ms", type=float, default=None, help="simulated forward per layer (default bwd/2)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "scaling.json"))
    a = ap.parse_args()
    fwd_ms = a.fwd_ms if a.fwd_ms is not None else a.bwd_ms / 2
    common = ["--params", str(int(a.params)), "--layers", str(a.layers), "--bwd-ms", str(a.bwd_ms),
              "--fwd-ms", str(fwd_ms), "--steps", str(a.steps), "--warmup", str(a.warmup)]
    if a.worker:
        worker(a.mode, int(a.params), a.layers, fwd_ms / 1e3, a.bwd_ms / 1e3, a.steps, a.warmup)
        return
    from _spawn import machine_info, run_ranks, write_results

    info = machine_info()
    ranks = [int(r) for r in a.ranks.split(",")]
    print(f"machine: {info['cpus']} cpus, load {info['loadavg_1min']}; model {a.params / 1e6:.0f}M parameters in "
          f"{a.layers} layers, simulated compute {a.layers * (a.bwd_ms + fwd_ms):.0f} ms per step", flush=True)
    configs = [("ours-smddp", "1 node"), ("ours-smddp", "1 rank/node"), ("ddp-gloo", "tcp")]
    rows, base = [], {}
    for world in ranks:
        for mode, layout in configs:
            if world == 1 and layout != configs[0][1] and mode == "ours-smddp":
                continue  # one rank is one layout
            per_node = world if layout == "1 node" else 1
            out = run_ranks(os.path.abspath(__file__), world, per_node, ["--mode", mode] + common,
                            extra_env={"OPENBLAS_NUM_THREADS": "1"})
            if not all(o["grad_ok"] for o in out):
                raise RuntimeError(f"{mode} at {world} ranks produced wrong gradients: {out}")
            sps = min(o["steps_per_s"] for o in out)
            if world == 1:
                base[mode] = sps
            row = {"world": world, "mode": mode, "layout": layout if world > 1 else "1 rank", "steps_per_s_per_rank": sps,
                   "efficiency": sps / base[mode], "loadavg_1min": os.getloadavg()[0]}
            if "exposed_comm_s" in out[0]:
                row["exposed_comm_s"] = max(o["exposed_comm_s"] for o in out)
            rows.append(row)
            print(f"{world} ranks {mode:11s} {row['layout']:12s} {sps:6.3f} steps/s per rank  efficiency "
                  f"{100 * row['efficiency']:5.1f}%" + (f"  exposed comm {1e3 * row['exposed_comm_s']:.0f} ms"
                                                       if "exposed_comm_s" in row else ""), flush=True)
    write_results(a.out, info, rows, params=a.params, layers=a.layers, bwd_ms=a.bwd_ms, fwd_ms=fwd_ms)


if __name__ == "__main__":
    main()
