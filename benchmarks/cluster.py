"""all_reduce across real test hosts joined by shaped links: smddp vs gloo, against the link's limit.

    sudo python benchmarks/cluster.py --quick     # 2 hosts x 1, 2 ranks; 4 KiB, 64 MiB; fp32; 2 Gbit/s
    sudo python benchmarks/cluster.py             # 2, 4 hosts x 1, 2, 4 ranks; 4 KiB, 1 MiB, 64 MiB;
                                                  # fp32, fp16, bf16; 1 and 2 Gbit/s

Hosts come from sdp_jupyter.testing.cluster (network namespaces, own addresses and /dev/shm, links
shaped with tc tbf; needs root). For H hosts, L ranks per host and S bytes, a node-level algorithm
(shared memory inside a host, one sharded exchange between hosts) must move 2(H-1)/H x S over each
host's link in each direction; that over the link rate is `limit` below. A ring over all H x L
ranks, as gloo runs it (ranks of a host next to each other), moves 2(HL-1)/HL x S over each link
(`ring limit`): more than the node-level algorithm as soon as a host has several ranks. Printed per
layout: time per all_reduce, the limit, percent of the limit, the ratio to gloo measured in the same
run, and the CPU time per all_reduce of the busiest process on a host.

What holds smddp back from the limit is measured while it runs, per all_reduce: how busy the whole
machine was (/proc/stat: the test hosts share its cores), and how long the processes were ready
to run but waited for a core (the run-queue wait of /proc/<pid>/task/*/schedstat), the leaders'
(local rank 0, they drive the links between hosts) separately: `busy` and `lead-wait` in the table;
the JSON also has the CPU time of all ranks together and the machine's softirq and steal shares.
JSON goes to benchmarks/results/cluster.json.
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
from _spawn import agree, agreed_iterations, rank_env as _rank_env  # noqa: E402

RATES = {"1gbit": 1e9 / 8, "2gbit": 2e9 / 8}


def sched_ns() -> tuple[int, int]:
    """(ns on a CPU, ns waiting on a run queue for one) summed over this process's threads, from
    /proc/self/task/*/schedstat: the wait is the time the process was ready but not running."""
    on = wait = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:  # a thread that ended meanwhile
            continue
        on, wait = on + int(fields[0]), wait + int(fields[1])
    return on, wait


def machine_ticks() -> list[int]:
    """The whole machine's CPU ticks from /proc/stat (not namespaced): user nice system idle iowait
    irq softirq steal."""
    with open("/proc/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def machine_share(before: list[int], after: list[int]) -> dict:
    """Fractions of the machine's CPU time between two machine_ticks(): busy (not idle or iowait),
    and the parts of it spent in the kernel's network work (softirq) and taken by the hypervisor
    (steal)."""
    d = [b - a for a, b in zip(before, after)]
    total = sum(d) or 1
    return {"busy": 1 - (d[3] + d[4]) / total, "softirq": d[6] / total, "steal": d[7] / total}


TCP_COUNTERS = ("RetransSegs", "TCPTimeouts")


def tcp_counters() -> list[int]:
    """This network namespace's (this host's) TCP retransmitted segments and retransmission
    timeouts, from /proc/net/snmp and /proc/net/netstat."""
    found = {}
    for path in ("/proc/net/snmp", "/proc/net/netstat"):
        with open(path) as f:
            lines = f.read().splitlines()
        for names, values in zip(lines[::2], lines[1::2]):
            found.update(zip(names.split()[1:], values.split()[1:]))
    return [int(found.get(k, 0)) for k in TCP_COUNTERS]


def worker(out: str, sizes: list[int], dtypes: list[str], budget: float) -> None:
    import torch
    import torch.distributed as dist

    nice = int(os.environ.get("BENCH_NICE_OTHERS", "0"))
    if nice and int(os.environ["LOCAL_RANK"]) != 0:
        os.nice(nice)  # --nice-others: the leaders get the cores first (a diagnosis, see --help)
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
            m0, (_, wait0), tcp0 = machine_ticks(), sched_ns(), tcp_counters()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(reps):
                dist.all_reduce(t)
            wall = (time.perf_counter() - t0) / reps
            cpu = (time.process_time() - c0) / reps
            _, wait1 = sched_ns()
            share = machine_share(m0, machine_ticks())
            runq = (wait1 - wait0) / 1e9 / reps
            leader = int(os.environ.get("LOCAL_RANK", "0")) == 0
            # one rank per host counts its host's TCP losses (the counters are the namespace's)
            tcp = [(b - a) / reps if leader else 0.0 for a, b in zip(tcp0, tcp_counters())]
            # everyone agrees on the slowest rank's time (what a training step waits for), the
            # busiest rank's CPU, and the longest run-queue wait of any rank and of a host's leader
            # (local rank 0, the one that drives the links between hosts)
            agg = torch.tensor([wall, cpu, runq, runq if leader else 0.0], dtype=torch.float64)
            dist.all_reduce(agg, op=dist.ReduceOp.MAX)
            total = torch.tensor([cpu, runq, *tcp], dtype=torch.float64)
            dist.all_reduce(total)
            rows.append({"dtype": dtype, "bytes": size, "time_s": agg[0].item(), "cpu_s_max": agg[1].item(),
                         "runq_s_max": agg[2].item(), "runq_s_leader": agg[3].item(),
                         "cpu_s_all": total[0].item(), "runq_s_all": total[1].item(),
                         "machine": share, "retrans_per_op": total[2].item(), "rto_per_op": total[3].item(),
                         "reps": reps})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def rank_env(c, rank: int, world: int, per_host: int, port: int, secret: str, extra: dict) -> dict:
    """The environment of rank `rank` on cluster `c` (ranks of a host next to each other), torchrun's
    variables plus the job secret (_spawn.rank_env), gloo on the hosts' eth0, and `extra`."""
    return _rank_env(rank, world, per_host, port, secret, addr=c.addresses[0], extra={
        "GLOO_SOCKET_IFNAME": "eth0", "TORCH_CPP_LOG_LEVEL": "ERROR",
        "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), **extra})


def run_layout(c, hosts: int, per_host: int, backend: str, sizes, dtypes, budget, nice_others: int = 0) -> list[dict]:
    import tempfile

    port = 29500 + secrets.randbelow(2000)
    out = tempfile.mktemp(prefix="sdp-cluster-bench-", suffix=".json")
    secret = secrets.token_hex(16)
    procs = []
    world = hosts * per_host
    for r in range(world):
        h = r // per_host
        env = rank_env(c, r, world, per_host, port, secret, {"BENCH_BACKEND": backend, "SDP_TIMEOUT": "120",
                                                             "BENCH_NICE_OTHERS": str(nice_others)})
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


def explain(rows: list[dict], leaders_first: list[dict], cores: int) -> list[dict]:
    """What holds each 64 MiB row below 90 % of the link's limit, from the measurements of a sweep
    (`rows`) and, when given, of the same sweep run with --nice-others (`leaders_first`):

    - `machine_cpu_s`: the whole machine's CPU time per all_reduce (busy share x cores x time), all
      ranks and the kernel's network work of every test host together;
    - `cores_for_90`: the cores that work needs to fit in the time 90 % of the limit allows; more
      than the machine has means the cores, not the links or the algorithm, hold the row back;
    - `leader_wait`: the share of the all_reduce a leader spent ready to run but without a core;
    - `pct_leaders_first`: the same row with the other ranks niced (--nice-others).

    `held_back_by` is "cores" when cores_for_90 exceeds the machine's cores, else "waiting for a
    core" when the leaders waited for a core for a fifth of the time or more, else "not the cores"
    (what is left is the pipeline's own: see docs/benchmarks.md section 8 for its measurement)."""
    first = {(r["hosts"], r["per_host"], r["rate"], r["dtype"], r["bytes"]): r for r in leaders_first}
    out = []
    for r in rows:
        if r["bytes"] < 1 << 20 or r["pct_of_limit"] >= 90 or "smddp_machine" not in r:
            continue
        machine_cpu = r["smddp_machine"]["busy"] * cores * r["smddp_s"]
        cores_90 = machine_cpu / (r["limit_s"] / 0.9)
        wait = r["smddp_runq_s_leader"] / r["smddp_s"]
        f = first.get((r["hosts"], r["per_host"], r["rate"], r["dtype"], r["bytes"]))
        why = "cores" if cores_90 > cores else "waiting for a core" if wait >= 0.2 else "not the cores"
        out.append({"hosts": r["hosts"], "per_host": r["per_host"], "rate": r["rate"], "dtype": r["dtype"],
                    "pct_of_limit": r["pct_of_limit"], "busy": r["smddp_machine"]["busy"],
                    "machine_cpu_s": machine_cpu, "cores_for_90": cores_90, "leader_wait": wait,
                    "retrans_per_op": r.get("retrans_per_op", {}).get("smddp"),
                    "pct_leaders_first": f["pct_of_limit"] if f else None, "held_back_by": why})
    return out


def print_explained(rows: list[dict], cores: int) -> None:
    print(f"64 MiB rows under 90 % of the limit, on {cores} cores:")
    print(f"{'layout':<18} {'rate':>6} {'dtype':>8} | {'% limit':>7} | {'busy':>5} {'CPU/op':>8} {'cores@90%':>9} | "
          f"{'leader wait':>11} | {'leaders 1st':>11} | {'retrans/op':>10} | held back by")
    for e in rows:
        lf = f"{e['pct_leaders_first']:.0f}%" if e["pct_leaders_first"] is not None else "-"
        rt = f"{e['retrans_per_op']:.0f}" if e["retrans_per_op"] is not None else "-"
        print(f"{e['hosts']} hosts x {e['per_host']} rank{'s' if e['per_host'] > 1 else ' '}  {e['rate']:>6} "
              f"{e['dtype']:>8} | {e['pct_of_limit']:>6.0f}% | {100 * e['busy']:>4.0f}% {e['machine_cpu_s'] * 1e3:>6.0f}ms "
              f"{e['cores_for_90']:>9.2f} | {100 * e['leader_wait']:>10.0f}% | {lf:>11} | {rt:>10} | {e['held_back_by']}")


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
    ap.add_argument("--queue-ms", type=float, default=5.0,
                    help="how long a packet may wait in a link's queue (tc tbf latency; default 5): the queue "
                         "holds rate x this plus the 256 KB burst, a longer one drops less")
    ap.add_argument("--nice-others", type=int, default=0,
                    help="a diagnosis: run every rank but each host's first (the leader, that drives the links) "
                         "at this nice level, so that on a machine with fewer cores than ranks the leaders "
                         "wait less for a core; compare with and without (default 0: all equal)")
    ap.add_argument("--explain", nargs="+", metavar="JSON",
                    help="print what holds each 64 MiB row under 90 %% of the limit back, from a sweep's results "
                         "and, as a second file, the same sweep run with --nice-others (see explain() in this file); "
                         "runs nothing")
    a = ap.parse_args()
    if a.explain:
        runs = []
        for path in a.explain[:2]:
            with open(path) as f:
                runs.append(json.load(f))
        cores = runs[0].get("cpus", 2)
        rows = explain(runs[0]["rows"], runs[1]["rows"] if len(runs) > 1 else [], cores)
        print_explained(rows, cores)
        return 0
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
          f"(queue {a.queue_ms:g} ms; netem {'available' if netem_available() else 'absent: no added delay'})")
    results = []
    header = (f"{'layout':<18} {'rate':>6} {'dtype':>8} {'size':>9} | {'smddp':>9} {'gloo':>9} | {'limit':>8} "
              f"{'% limit':>7} | {'vs gloo':>7} | {'ring lim':>8} | cpu/op smddp gloo | smddp: busy lead-wait | "
              f"retrans/op smddp gloo")
    print(header)
    for rate in rates:
        bps = RATES.get(rate) or float(rate.rstrip("bit").replace("g", "e9").replace("m", "e6")) / 8
        for hosts in hosts_list:
            with Cluster(hosts=hosts, rate=rate, latency=f"{a.queue_ms:g}ms") as c:
                for per_host in per_list:
                    measured = {b: run_layout(c, hosts, per_host, b, sizes, dtypes, a.budget, a.nice_others)
                                for b in ("smddp", "gloo")}
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
                               "queue_ms": a.queue_ms, "nice_others": a.nice_others, "cpu_s_smddp": s_row["cpu_s_max"], "cpu_s_gloo": g_row["cpu_s_max"], "load": load,
                               # where the time went while smddp ran (see the module docstring)
                               "smddp_cpu_s_all": s_row["cpu_s_all"], "smddp_runq_s_max": s_row["runq_s_max"],
                               "smddp_runq_s_leader": s_row["runq_s_leader"],
                               "smddp_runq_s_all": s_row["runq_s_all"], "smddp_machine": s_row["machine"],
                               "retrans_per_op": {"smddp": s_row["retrans_per_op"], "gloo": g_row["retrans_per_op"]},
                               "rto_per_op": {"smddp": s_row["rto_per_op"], "gloo": g_row["rto_per_op"]}}
                        results.append(row)
                        print(f"{hosts} hosts x {per_host} rank{'s' if per_host > 1 else ' '}  {rate:>6} "
                              f"{row['dtype']:>8} {size / 1024:>7.0f}K | {row['smddp_s'] * 1e3:>7.2f}ms "
                              f"{row['gloo_s'] * 1e3:>7.2f}ms | {limit * 1e3:>6.1f}ms {row['pct_of_limit']:>6.0f}% | "
                              f"x{row['ratio_vs_gloo']:>5.2f} | {ring * 1e3:>6.1f}ms | "
                              f"{row['cpu_s_smddp'] * 1e3:.1f} {row['cpu_s_gloo'] * 1e3:.1f} ms | "
                              f"{100 * row['smddp_machine']['busy']:.0f}% {row['smddp_runq_s_leader'] * 1e3:.1f} ms | "
                              f"{row['retrans_per_op']['smddp']:.0f} {row['retrans_per_op']['gloo']:.0f}",
                              flush=True)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"load": load, "cpus": os.cpu_count(), "command": " ".join(sys.argv), "rows": results}, f, indent=1)
    print(f"results: {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
