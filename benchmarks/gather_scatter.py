"""all_gather and reduce_scatter: the engine's native collectives vs gloo, in the same run.

    python benchmarks/gather_scatter.py                  # 64 MiB (the gathered / scattered buffer), fp32, 2 and 4 ranks
    python benchmarks/gather_scatter.py --quick          # 1 MiB and 64 MiB, 2 ranks

smddp runs through sdp_jupyter.comm (numpy buffers: the engine's own all_gather/reduce_scatter);
gloo through torch.distributed. Both as one node and as one rank per node. The size is the whole
buffer (world_size blocks). Writes benchmarks/results/gather_scatter.json.
"""
from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def worker(backend: str, sizes: list[int], budget: float) -> None:
    import numpy as np

    from _spawn import median_time as _time

    out = []
    if backend == "smddp":
        from sdp_jupyter import comm

        c = comm.init()
        world, rank = c.world_size, c.rank

        def agree(t):  # every rank runs the same number of iterations
            a = np.array([t])
            c.all_reduce(a, op="max")
            return float(a[0])
        for size in sizes:
            n = size // 4 // world
            big, small = np.ones(n * world, dtype=np.float32), np.ones(n, dtype=np.float32)
            ag = _time(lambda: c.all_gather(big, small), budget, agree)
            rs = _time(lambda: c.reduce_scatter(small, big), budget, agree)
            out.append({"bytes": size, "all_gather_s": ag, "reduce_scatter_s": rs})
        comm.shutdown()
    else:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()

        from _spawn import agree

        for size in sizes:
            n = size // 4 // world
            big, small = torch.ones(n * world), torch.ones(n)
            ag = _time(lambda: dist.all_gather_into_tensor(big, small), budget, agree)
            try:  # reduce_scatter_tensor on gloo needs a recent torch
                rs = _time(lambda: dist.reduce_scatter_tensor(small, big), budget, agree)
            except (RuntimeError, NotImplementedError, ValueError):
                rs = float("nan")
            out.append({"bytes": size, "all_gather_s": ag, "reduce_scatter_s": rs})
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "world": world, "rows": out}))


def main() -> None:
    from _spawn import bench_parser

    ap = bench_parser(__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--ranks", default=None, help="comma list of world sizes (default 2,4; quick: 2)")
    ap.add_argument("--sizes", default=None, help="comma list of bytes (default 64 MiB; quick: 1 MiB,64 MiB)")
    ap.add_argument("--budget", type=float, default=0.5)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "gather_scatter.json"))
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")] if a.sizes else ([1 << 20, 64 << 20] if a.quick else [64 << 20])
    if a.worker:
        worker(a.backend, sizes, a.budget)
        return
    from _spawn import backend_runs, machine_info, slowest, write_results

    ranks = [int(r) for r in a.ranks.split(",")] if a.ranks else ([2] if a.quick else [2, 4])
    info = machine_info()
    print(f"machine: {info['cpus']} cpus, load {info['loadavg_1min']}", flush=True)
    rows = []
    args = ["--sizes", ",".join(map(str, sizes)), "--budget", str(a.budget)]
    for world, layout, res in backend_runs(os.path.abspath(__file__), ranks, args):
        for i, size in enumerate(sizes):
            for coll in ("all_gather", "reduce_scatter"):
                t = {b: slowest(res[b], i, f"{coll}_s") for b in res}
                row = {"world": world, "layout": layout, "coll": coll, "bytes": size,
                       "smddp_ms": t["smddp"] * 1e3, "gloo_ms": t["gloo"] * 1e3, "speedup": t["gloo"] / t["smddp"]}
                rows.append(row)
                print(f"{world} ranks {layout:12s} {coll:15s} {size / 1024:>8.0f} KiB | smddp {row['smddp_ms']:8.2f} ms"
                      f" | gloo {row['gloo_ms']:8.2f} ms | x{row['speedup']:5.2f}", flush=True)
    write_results(a.out, info, rows)

if __name__ == "__main__":
    main()
