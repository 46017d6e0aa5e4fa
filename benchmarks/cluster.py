"""all_reduce across real test hosts joined by shaped links: smddp vs gloo, against the link's limit.

    sudo python benchmarks/cluster.py --quick     # 2 hosts x 1, 2 ranks; 4 KiB, 64 MiB; fp32; 2 Gbit/s
    sudo python benchmarks/cluster.py             # 2, 4 hosts x 1, 2, 4 ranks; 4 KiB, 1 MiB, 64 MiB;
                                                  # fp32, fp16, bf16; 1 and 2 Gbit/s

Hosts come from sdp_jupyter.testing.cluster (network namespaces, own addresses and /dev/shm, links
shaped with tc tbf; needs root). For H hosts, L ranks per host and S bytes, a node-level algorithm
(shared memory inside a host, one sharded exchange between hosts) must move 2(H-1)/H x S over each
host's link in each direction; that over the link rate is `limit` below. A ring over all H x L
ranks, as gloo runs it (ranks of a host next to each other), moves 2(HL-1)/HL x S over each link
(`ring limit`): more than the node-level algorithm as soon as a host has several ranks. Printed per layout: time per all_reduce, the limit, percent
of the limit, the ratio to gloo measured in the same run, and the CPU time per all_reduce of the
busiest process on a host. JSON goes to benchmarks/results/cluster.json.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _spawn import agree, agreed_iterations  # noqa: E402

RATES = {"1gbit": 1e9 / 8, "2gbit": 2e9 / 8}


def worker(out: str, sizes: list[int], dtypes: list[str], budget: float) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(os.environ["BENCH_BACKEND"])
    rank = dist.get_rank()
    rows = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for size in sizes:
            n = size // torch.empty(0, dtype=dt).element_size()
            t = torch.ones(n, dtype=dt)
            dist.all_reduce(t)
            dist.barrier()
            # the number of calls is agreed (_spawn.agreed_iterations): ranks that each watched
            # their own clock once disagreed (one left the loop while another sent 64 MiB more)
            reps = agreed_iterations(lambda: dist.all_reduce(t), budget, agree, cap=200)
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps):
                dist.all_reduce(t)
            wall = (time.perf_counter() - t0) / reps
            cpu = (time.process_time() - c0) / reps
            # everyone agrees on the slowest rank's time (what a training step waits for)
            agg = torch.tensor([wall, cpu], dtype=torch.float64)
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)
            rows.append({"dtype": dtype, "bytes": size, "time_s": agg[0].item(), "cpu_s_max": agg[1].item(),
                         "reps": reps})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def rank_env(c, rank: int, world: int, per_host: int, port: int, secret: str, extra: dict) -> dict:
    """The environment of rank `rank` on cluster `c` (ranks of a host next to each other), torchrun's
    variables plus the job secret, gloo on the hosts' eth0, and `extra`."""
    h, local = divmod(rank, per_host)
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(per_host), "GROUP_RANK": str(h), "MASTER_ADDR": c.addresses[0],
                "MASTER_PORT": str(port), "SDP_JOB_SECRET": secret, "GLOO_SOCKET_IFNAME": "eth0",
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "PYTHONPATH": os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")])), **extra})
    return env


def run_layout(c, hosts: int, per_host: int, backend: str, sizes, dtypes, budget) -> list[dict]:
    import tempfile

    port = 29500 + secrets.randbelow(2000)
    out = tempfile.mktemp(prefix="sdp-cluster-bench-", suffix=".json")
    secret = secrets.token_hex(16)
    procs = []
    world = hosts * per_host
    for r in range(world):
        h = r // per_host
        env = rank_env(c, r, world, per_host, port, secret, {"BENCH_BACKEND": backend, "SDP_TIMEOUT": "120"})
        procs.append(c.popen(h, [sys.executable, __file__, "--worker", "--out", out,
                                 "--sizes", ",".join(map(str, sizes)), "--dtypes", ",".join(dtypes),
                                 "--budget", str(budget)], env=env,
                             stdout=subprocess.DEVNULL if r else None))
    codes = [p.wait(timeout=1800) for p in procs]
    if any(codes):
        raise RuntimeError(f"{backend} {hosts}x{per_host}: exit codes {codes}")
    with open(out) as f:
        rows = json.load(f)
    os.unlink(out)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cluster.json"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hosts", default=None, help="comma list (default 2,4; quick: 2)")
    ap.add_argument("--per-host", default=None, help="comma list (default 1,2,4; quick: 1,2)")
    ap.add_argument("--sizes", default=None, help="comma list of bytes")
    ap.add_argument("--dtypes", default=None)
    ap.add_argument("--rates", default=None, help="comma list of tc rates (default 1gbit,2gbit; quick: 2gbit)")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per size (at least 3 all_reduces)")
    a = ap.parse_args()
    sizes = [int(s) for s in (a.sizes or ("4096,67108864" if a.quick else "4096,1048576,67108864")).split(",")]
    dtypes = (a.dtypes or ("float32" if a.quick else "float32,float16,bfloat16")).split(",")
    if a.worker:
        worker(a.out, sizes, dtypes, a.budget)
        return 0
    from sdp_jupyter.testing.cluster import Cluster, available, netem_available

    why = available()
    if why:
        print(f"cannot make test hosts here: {why}", file=sys.stderr)
        return 2
    hosts_list = [int(x) for x in (a.hosts or ("2" if a.quick else "2,4")).split(",")]
    per_list = [int(x) for x in (a.per_host or ("1,2" if a.quick else "1,2,4")).split(",")]
    rates = (a.rates or ("2gbit" if a.quick else "1gbit,2gbit")).split(",")
    load = os.getloadavg()[0]
    print(f"machine: {os.cpu_count()} cpus, load {load:.2f}; links shaped with tc tbf "
          f"(netem {'available' if netem_available() else 'absent: no added delay'})")
    results = []
    header = (f"{'layout':<18} {'rate':>6} {'dtype':>8} {'size':>9} | {'smddp':>9} {'gloo':>9} | {'limit':>8} "
              f"{'% limit':>7} | {'vs gloo':>7} | {'ring lim':>8} | cpu/op smddp gloo")
    print(header)
    for rate in rates:
        bps = RATES.get(rate) or float(rate.rstrip("bit").replace("g", "e9").replace("m", "e6")) / 8
        for hosts in hosts_list:
            with Cluster(hosts=hosts, rate=rate) as c:
                for per_host in per_list:
                    measured = {b: run_layout(c, hosts, per_host, b, sizes, dtypes, a.budget) for b in ("smddp", "gloo")}
                    for s_row, g_row in zip(measured["smddp"], measured["gloo"]):
                        size = s_row["bytes"]
                        limit = 2 * (hosts - 1) / hosts * size / bps
                        hl = hosts * per_host
                        ring = 2 * (hl - 1) / hl * size / bps
                        row = {"hosts": hosts, "per_host": per_host, "rate": rate, "dtype": s_row["dtype"],
                               "bytes": size, "smddp_s": s_row["time_s"], "gloo_s": g_row["time_s"],
                               "limit_s": limit, "ring_limit_s": ring,
                               "pct_of_limit": 100 * limit / s_row["time_s"],
                               "ratio_vs_gloo": g_row["time_s"] / s_row["time_s"],
                               "cpu_s_smddp": s_row["cpu_s_max"], "cpu_s_gloo": g_row["cpu_s_max"], "load": load}
                        results.append(row)
                        print(f"{hosts} hosts x {per_host} rank{'s' if per_host > 1 else ' '}  {rate:>6} "
                              f"{row['dtype']:>8} {size / 1024:>7.0f}K | {row['smddp_s'] * 1e3:>7.2f}ms "
                              f"{row['gloo_s'] * 1e3:>7.2f}ms | {limit * 1e3:>6.1f}ms {row['pct_of_limit']:>6.0f}% | "
                              f"x{row['ratio_vs_gloo']:>5.2f} | {ring * 1e3:>6.1f}ms | "
                              f"{row['cpu_s_smddp'] * 1e3:.1f} {row['cpu_s_gloo'] * 1e3:.1f} ms", flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"load": load, "rows": results}, f, indent=1)
    print(f"results: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
