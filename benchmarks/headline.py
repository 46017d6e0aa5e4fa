"""The headline benchmark across hosts: data-parallel training of a BERT-large-shaped model on 1, 2 and
4 test hosts x 4 ranks; stock DDP on gloo against stock DDP on smddp and the engine's wrapper.

    sudo python benchmarks/headline.py                      # 1, 2, 4 hosts x 4 ranks at 2 Gbit/s
    sudo python benchmarks/headline.py --hosts 1,2 --steps 3 --blocks 1   # a quicker look

The model: `--blocks` transformer blocks with BERT-large's layer sizes (hidden 1024, feed-forward
4096: the four 1024x1024 attention projections, the two feed-forward matrices, their biases and the
two LayerNorms, 12.6M parameters per block; BERT-large has 24 of them and 31.8M parameters of
embeddings, 335M in all). Every parameter gets a real gradient each step, so real gradient bytes
cross the links; the compute is simulated per block as in benchmarks/scaling.py (forward and backward
sleep, leaving the CPU to communication, as a GPU would). 16 ranks of the whole 335M-parameter model
need about 64 GiB here, so the model is cut to `--blocks` blocks and the compute per step scaled with
it, keeping the ratio of communication to compute of SMDDP's BERT-large runs on p3dn.24xlarge:

    p3dn: per GPU batch 32 sequences of 128 tokens at ~300 sequences/s (V100, mixed precision) is
          ~107 ms of compute per step; 335M fp16 gradients are 670 MB; a node's 100 Gbit/s link
          moves the node-level algorithm's 2(H-1)/H x 670 MB in 54 ms at 2 nodes: comm/compute 0.50
    here: G gradient bytes (fp32) over `--rate`; compute per step = (G / rate) / 0.50 (--ratio)

so at 2 hosts the gradients need half a step's compute to cross the link, as on p3dn. Reported per
layout and mode: samples/s (4 samples per rank per step), scaling efficiency against one host of
the same mode, and the ratio to DDP on gloo measured in the same run; and, as in
benchmarks/cluster.py, how busy the whole machine was during the timed steps and the longest time a
rank waited for a core per step (its run-queue wait): where that is a large part of the step, the
machine rather than the links or the algorithm sets the pace. JSON to
benchmarks/results/headline.json, and a plotly figure (HTML) to docs/assets/headline.html when plotly is installed.

Bounds: per link a ring over H x L ranks moves 2(HL-1)/HL of the gradients, the node-level
algorithm 2(H-1)/H; so where communication dominates smddp can be at most x1.75 gloo at 2 x 4 and
x1.25 at 4 x 4. Hosts come from sdp_jupyter.testing.cluster (needs root).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from cluster import machine_share, machine_ticks, rank_env, sched_ns  # noqa: E402

HIDDEN, FFN = 1024, 4096
# BERT-large's encoder block: (shape of each parameter tensor)
BLOCK = [(HIDDEN, HIDDEN), (HIDDEN,)] * 4 + [(FFN, HIDDEN), (FFN,), (HIDDEN, FFN), (HIDDEN,)] + [(HIDDEN,)] * 4
BERT_LARGE_PARAMS = 335e6
SAMPLES_PER_RANK = 4
MODES = ("ddp-gloo", "ddp-smddp", "ours-smddp")


def block_params() -> int:
    n = 0
    for shape in BLOCK:
        k = 1
        for d in shape:
            k *= d
        n += k
    return n


def build(blocks: int, fwd_s: float, bwd_s: float):
    from models import sleeping_model

    return sleeping_model([BLOCK] * blocks, fwd_s, bwd_s)


def worker(mode: str, blocks: int, fwd_s: float, bwd_s: float, steps: int, warmup: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch as sdt

    torch.set_num_threads(1)
    dist.init_process_group("gloo" if mode == "ddp-gloo" else "smddp")
    model = build(blocks, fwd_s, bwd_s)
    if dist.get_world_size() == 1:
        ddp = model
    elif mode == "ours-smddp":
        ddp = sdt.DistributedDataParallel(model, report_metrics=False)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=True)
    x = torch.ones(SAMPLES_PER_RANK, 16, requires_grad=True)
    for i in range(warmup + steps):
        if i == warmup:
            dist.barrier()
            t0, m0, (_, wait0) = time.perf_counter(), machine_ticks(), sched_ns()
        for p in model.parameters():
            p.grad = None
        ddp(x).sum().backward()
    dist.barrier()
    elapsed = time.perf_counter() - t0
    share, (_, wait1) = machine_share(m0, machine_ticks()), sched_ns()
    ok = all(abs(float(p.grad.view(-1)[0]) - 1e-3) < 1e-7 for p in model.parameters())
    # the slowest rank's time, and the longest any rank was ready to run without a core (per step)
    agg = torch.tensor([elapsed, 0.0 if ok else 1.0, (wait1 - wait0) / 1e9 / steps], dtype=torch.float64)
    dist.all_reduce(agg, op=dist.ReduceOp.MAX)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump({"elapsed_s": agg[0].item(), "grad_ok": agg[1].item() == 0.0, "machine_busy": share["busy"],
                       "runq_s_per_step_max": agg[2].item()}, f)
    dist.destroy_process_group()


def run(c, hosts: int, per_host: int, mode: str, common: list) -> dict:
    port = 29500 + secrets.randbelow(2000)
    fd, out = tempfile.mkstemp(prefix="sdp-headline-", suffix=".json")
    os.close(fd)
    secret = secrets.token_hex(16)
    world = hosts * per_host
    procs = []
    for r in range(world):
        h = r // per_host
        env = rank_env(c, r, world, per_host, port, secret, {"SDP_TIMEOUT": "300", "OPENBLAS_NUM_THREADS": "1"})
        procs.append(c.popen(h, [sys.executable, __file__, "--worker", "--mode", mode, "--out", out] + common,
                             env=env, stdout=subprocess.DEVNULL if r else None))
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    if any(codes):
        raise RuntimeError(f"{mode} {hosts}x{per_host}: exit codes {codes}")
    with open(out) as f:
        res = json.load(f)
    os.unlink(out)
    if not res["grad_ok"]:
        raise RuntimeError(f"{mode} {hosts}x{per_host}: wrong gradients")
    return res


def plot(rows: list, path: str) -> str | None:
    try:
        import plotly.graph_objects as go
    except ImportError:
        return None
    fig = go.Figure()
    for mode in MODES:
        pts = [r for r in rows if r["mode"] == mode]
        fig.add_bar(name=mode, x=[f"{r['hosts']} x {r['per_host']}" for r in pts],
                    y=[r["samples_per_s"] for r in pts],
                    text=[f"{100 * r['efficiency']:.0f} %" for r in pts], textposition="outside")
    fig.update_layout(title="BERT-large-shaped data parallel training across test hosts (bar label: scaling "
                            "efficiency against one host)", xaxis_title="hosts x ranks per host",
                      yaxis_title="samples/s", barmode="group")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.write_html(path, include_plotlyjs="cdn")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="ours-smddp", help=argparse.SUPPRESS)
    ap.add_argument("--hosts", default="1,2,4", help="comma list of host counts (default 1,2,4)")
    ap.add_argument("--per-host", type=int, default=4, help="ranks per host (default 4)")
    ap.add_argument("--blocks", type=int, default=2, help="BERT-large encoder blocks in the model (default 2)")
    ap.add_argument("--rate", default="2gbit", help="each host's link, as tc writes it (default 2gbit)")
    ap.add_argument("--ratio", type=float, default=0.5,
                    help="communication at 2 hosts over compute per step (default 0.5: SMDDP's BERT-large on p3dn)")
    ap.add_argument("--compute-s", type=float, default=None, help="compute per step in seconds (default: from --ratio)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--fwd-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--bwd-s", type=float, default=0.0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "headline.json"))
    ap.add_argument("--plot", default=os.path.join(os.path.dirname(HERE), "docs", "assets", "headline.html"),
                    help="where the plotly figure goes (default docs/assets/headline.html: the docs show it)")
    a = ap.parse_args()
    if a.worker:
        worker(a.mode, a.blocks, a.fwd_s, a.bwd_s, a.steps, a.warmup, a.out)
        return 0
    from sdp_jupyter.testing.cluster import Cluster, available

    why = available()
    if why:
        print(f"cannot make test hosts here: {why}", file=sys.stderr)
        return 2
    params = a.blocks * block_params()
    grad_bytes = params * 4
    bps = float(a.rate.lower().rstrip("bit").replace("g", "e9").replace("m", "e6")) / 8
    compute = a.compute_s if a.compute_s is not None else grad_bytes / bps / a.ratio
    per_block = compute / a.blocks
    fwd, bwd = per_block / 3, 2 * per_block / 3  # backward about twice the forward
    common = ["--blocks", str(a.blocks), "--steps", str(a.steps), "--warmup", str(a.warmup),
              "--fwd-s", f"{fwd:.6f}", "--bwd-s", f"{bwd:.6f}"]
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cpus, load {load:.2f}; model {params / 1e6:.1f}M parameters "
          f"({a.blocks} BERT-large blocks, {params / BERT_LARGE_PARAMS:.3f} of BERT-large), gradients "
          f"{grad_bytes / 2**20:.0f} MiB fp32; links {a.rate}; simulated compute {compute:.2f} s per step", flush=True)
    print(f"{'layout':<14} {'mode':<11} {'samples/s':>10} {'efficiency':>10} {'vs gloo':>8} {'busy':>6} "
          f"{'core wait':>11}")
    rows, base = [], {}
    for hosts in [int(h) for h in a.hosts.split(",")]:
        with Cluster(hosts=hosts, rate=a.rate) as c:
            measured, waits = {}, {}
            for mode in MODES:
                res = run(c, hosts, a.per_host, mode, common)
                world = hosts * a.per_host
                measured[mode] = world * SAMPLES_PER_RANK * a.steps / res["elapsed_s"]
                waits[mode] = res
            for mode in MODES:
                sps = measured[mode]
                base.setdefault(mode, (sps, hosts))
                eff = sps / (base[mode][0] * hosts / base[mode][1])
                row = {"hosts": hosts, "per_host": a.per_host, "mode": mode, "samples_per_s": sps,
                       "efficiency": eff, "ratio_vs_gloo": sps / measured["ddp-gloo"], "load": os.getloadavg()[0],
                       "machine_busy": waits[mode]["machine_busy"],
                       "runq_s_per_step_max": waits[mode]["runq_s_per_step_max"]}
                rows.append(row)
                print(f"{hosts} x {a.per_host:<10} {mode:<11} {sps:>10.2f} {100 * eff:>9.0f}% "
                      f"x{row['ratio_vs_gloo']:>6.2f} {100 * row['machine_busy']:>5.0f}% "
                      f"{row['runq_s_per_step_max'] * 1e3:>8.0f} ms", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load": load, "params": params,
                   "grad_bytes": grad_bytes, "rate": a.rate, "compute_s": compute, "ratio": a.ratio,
                   "steps": a.steps, "rows": rows}, f, indent=1)
    print(f"results: {a.out}")
    html = plot(rows, a.plot)
    if html:
        print(f"plot: {html}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
