"""Messages and the collectives built on them: smddp vs gloo through torch.distributed, same run.

    python benchmarks/messages.py            # 4 KiB and 64 MiB, 2 and 4 ranks, one node and 2 nodes
    python benchmarks/messages.py --quick    # 2 ranks only, a shorter timing budget per case

Operations: send/recv ping-pong (latency = half the round trip), send/recv one way (one message and
a 4-byte acknowledgement back; bandwidth = size / that time), gather and scatter (root 0) and
all_to_all_single. Pairs for send/recv are rank r and r + world/2, all pairs at once, so in the
"2 nodes" layout every pair crosses nodes. The size of gather, scatter and all_to_all_single is the
whole buffer (world blocks), as in gather_scatter.py. "2 nodes" gives the two halves of the ranks
different GROUP_RANKs; on one machine that is still loopback. Calls run back to back: the time and
the ratio are the mean per call over the timed loop, the slowest rank's (the cost of a call in a
stream of calls); the median of single calls is kept beside it (`*_median_ms`, "medians x"), which
can look fast where a call's work spills into the next. Writes benchmarks/results/messages.json.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

OPS = ("pingpong", "oneway", "gather", "scatter", "all_to_all_single")


def worker(backend: str, sizes: list[int], budget: float) -> None:
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401  (registers smddp)
    from _spawn import agree, call_times

    dist.init_process_group(backend)
    world, rank = dist.get_world_size(), dist.get_rank()
    half = world // 2
    lower = rank < half
    peer = rank + half if lower else rank - half

    out = []
    for size in sizes:
        n = size // 4
        msg, ack = torch.ones(n), torch.zeros(1)
        block = torch.ones(n // world)
        blocks = [torch.ones(n // world) for _ in range(world)]
        a2a_in, a2a_out = torch.ones(n // world * world), torch.empty(n // world * world)

        def exchange(answer):  # the lower rank of a pair sends msg, the upper one answers
            if lower:
                dist.send(msg, peer)
                dist.recv(answer, peer)
            else:
                dist.recv(msg, peer)
                dist.send(answer, peer)

        fns = {"pingpong": lambda: exchange(msg), "oneway": lambda: exchange(ack),
               "gather": lambda: dist.gather(block, blocks if rank == 0 else None, dst=0),
               "scatter": lambda: dist.scatter(block, blocks if rank == 0 else None, src=0),
               "all_to_all_single": lambda: dist.all_to_all_single(a2a_out, a2a_in)}
        for op in OPS:
            dist.barrier()
            median, mean = call_times(fns[op], budget, agree)
            out.append({"op": op, "bytes": size, "median_s": median, "mean_s": mean})
    dist.barrier()
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, "world": world, "rows": out}))


def main() -> None:
    from _spawn import bench_parser

    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="2 ranks, a shorter timing budget (about 2 minutes in all)")
    ap.add_argument("--ranks", default=None, help="comma list of even world sizes (default 2,4; quick: 2)")
    ap.add_argument("--sizes", default=f"{4 << 10},{64 << 20}", help="comma list of bytes")
    ap.add_argument("--budget", type=float, default=None, help="seconds of timing per case (default 1; quick 0.2)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "messages.json"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    budget = a.budget if a.budget is not None else (0.2 if a.quick else 1.0)
    if a.worker:
        worker(a.backend, sizes, budget)
        return
    from _spawn import backend_runs, machine_info, slowest, two_nodes, write_results

    ranks = [int(r) for r in a.ranks.split(",")] if a.ranks else ([2] if a.quick else [2, 4])
    info = machine_info()
    print(f"machine: {info['cpus']} cpus, single-core memcpy {info['memcpy_GBps']:.2f} GB/s, "
          f"load {info['loadavg_1min']}", flush=True)
    print("x = gloo time / smddp time (above 1: smddp faster); latency = half a ping-pong; "
          "GB/s = size / time (one way: per pair)", flush=True)
    rows = []
    args = ["--sizes", ",".join(map(str, sizes)), "--budget", str(budget)]
    for world, layout, res in backend_runs(os.path.abspath(__file__), ranks, args, layouts=two_nodes):
        for i, r in enumerate(res["smddp"][0]["rows"]):
            half = 2 if r["op"] == "pingpong" else 1  # one way of the round trip
            t = {b: slowest(res[b], i, "mean_s") / half for b in res}
            med = {b: slowest(res[b], i, "median_s") / half for b in res}
            row = {"world": world, "layout": layout, "op": r["op"], "bytes": r["bytes"],
                   "smddp_ms": t["smddp"] * 1e3, "gloo_ms": t["gloo"] * 1e3, "speedup": t["gloo"] / t["smddp"],
                   "smddp_GBps": r["bytes"] / t["smddp"] / 1e9, "gloo_GBps": r["bytes"] / t["gloo"] / 1e9,
                   "smddp_median_ms": med["smddp"] * 1e3, "gloo_median_ms": med["gloo"] * 1e3,
                   "median_speedup": med["gloo"] / med["smddp"], "loadavg_1min": os.getloadavg()[0]}
            rows.append(row)
            print(f"{world} ranks {layout:8s} {r['op']:17s} {r['bytes'] / 1024:>8.0f} KiB | smddp "
                  f"{row['smddp_ms']:9.3f} ms {row['smddp_GBps']:6.2f} GB/s | gloo {row['gloo_ms']:9.3f} ms "
                  f"{row['gloo_GBps']:6.2f} GB/s | x{row['speedup']:5.2f} (medians x{row['median_speedup']:5.2f})",
                  flush=True)
    write_results(a.out, info, rows, budget_s=budget)


if __name__ == "__main__":
    main()
