"""all_reduce: smddp vs gloo in the same run, as one node and as one rank per node.

    python benchmarks/allreduce.py                       # full sweep (4 KiB .. 256 MiB, fp32/fp16/bf16, 2 and 4 ranks)
    python benchmarks/allreduce.py --quick               # 4 KiB, 1 MiB, 64 MiB; fp32 and fp16; 2 ranks

Prints a table with latency, bus bandwidth (size/time x 2(n-1)/n) and the smddp/gloo ratio, the
single-core memcpy bandwidth of this machine measured in the same run (the ceiling), and writes
everything to benchmarks/results/allreduce.json.
"""
from __future__ import annotations

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SIZES_FULL = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20]
SIZES_QUICK = [4 << 10, 1 << 20, 64 << 20]


def worker(backend: str, sizes: list[int], dtypes: list[str], budget: float) -> None:
    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401
    from _spawn import agree

    dist.init_process_group(backend)
    world = dist.get_world_size()
    out = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for size in sizes:
            n = size // torch.empty(0, dtype=dt).element_size()
            t = torch.ones(n, dtype=dt)
            dist.all_reduce(t)  # warm-up: connections, first touch
            t0 = time.perf_counter()
            dist.all_reduce(t)
            # Every rank must run the same number of collectives: agree on the slowest estimate.
            est = agree(time.perf_counter() - t0)
            iters = int(min(200, max(3, budget / max(est, 1e-6))))
            # Warm up for about 0.1 s (at most 50 calls): right after set-up a rank's other threads
            # (the mailbox's listener, torch's) are still starting, and one call did not cover it.
            for _ in range(int(min(50, max(1, 0.1 / max(est, 1e-6))))):
                dist.all_reduce(t)
            dist.barrier()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                dist.all_reduce(t)
                times.append(time.perf_counter() - t0)
            times.sort()
            dist.barrier()
            out.append({"dtype": dtype, "bytes": size, "median_s": times[len(times) // 2], "min_s": times[0],
                        "iters": len(times)})
    dist.destroy_process_group()
    print(json.dumps({"rank": dist.get_rank() if dist.is_initialized() else None, "world": world, "rows": out}))


def main() -> None:
    from _spawn import bench_parser

    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="a few sizes, 2 ranks, fp32/fp16")
    ap.add_argument("--ranks", default=None, help="comma list of world sizes (default 2,4; quick: 2)")
    ap.add_argument("--dtypes", default=None, help="comma list (default float32,float16,bfloat16)")
    ap.add_argument("--sizes", default=None, help="comma list of bytes")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timing per size (at least 3 iterations)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "allreduce.json"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else (SIZES_QUICK if a.quick else SIZES_FULL)
    dtypes = a.dtypes.split(",") if a.dtypes else (["float32", "float16"] if a.quick else ["float32", "float16", "bfloat16"])
    if a.worker:
        worker(a.backend, sizes, dtypes, a.budget)
        return

    from _spawn import backend_runs, machine_info, slowest, write_results

    ranks = [int(r) for r in a.ranks.split(",")] if a.ranks else ([2] if a.quick else [2, 4])
    info = machine_info()
    print(f"machine: {info['cpus']} cpus, single-core memcpy {info['memcpy_GBps']:.2f} GB/s, "
          f"load {info['loadavg_1min']}", flush=True)
    rows = []
    args = ["--sizes", ",".join(map(str, sizes)), "--dtypes", ",".join(dtypes), "--budget", str(a.budget)]
    for world, layout, res in backend_runs(os.path.abspath(__file__), ranks, args):
        keys = [(r["dtype"], r["bytes"]) for r in res["smddp"][0]["rows"]]
        for i, (dtype, size) in enumerate(keys):
            f = 2 * (world - 1) / world
            row = {"world": world, "layout": layout, "dtype": dtype, "bytes": size}
            for b in ("smddp", "gloo"):
                t = slowest(res[b], i, "median_s")
                row[f"{b}_latency_us"] = t * 1e6
                row[f"{b}_busbw_GBps"] = size / t * f / 1e9
            row["busbw_ratio"] = row["smddp_busbw_GBps"] / row["gloo_busbw_GBps"]
            row["smddp_fraction_of_memcpy"] = row["smddp_busbw_GBps"] / info["memcpy_GBps"]
            rows.append(row)
            print(f"{world} ranks {layout:12s} {dtype:9s} {size / 1024:>9.0f} KiB | smddp "
                  f"{row['smddp_latency_us']:>10.0f} us {row['smddp_busbw_GBps']:6.2f} GB/s | gloo "
                  f"{row['gloo_latency_us']:>10.0f} us {row['gloo_busbw_GBps']:6.2f} GB/s | x{row['busbw_ratio']:5.2f}"
                  f" | {100 * row['smddp_fraction_of_memcpy']:4.0f}% memcpy", flush=True)
    write_results(a.out, info, rows)

if __name__ == "__main__":
    main()
