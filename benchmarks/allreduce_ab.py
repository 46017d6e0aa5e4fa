"""Is build B slower than build A on any all_reduce path? Two source trees, runs interleaved.

    python benchmarks/allreduce_ab.py BEFORE_TREE AFTER_TREE            # the rows of allreduce.py --quick
    python benchmarks/allreduce_ab.py /tmp/old . --rounds 6 --sizes 4096

Each tree is a checkout of this project with its engine built in place (`python setup.py
build_ext --inplace`); its ranks import sdp_jupyter from that tree (PYTHONPATH). For every row
(2 ranks; one node and one rank per node; float32 and float16; 4 KiB, 1 MiB, 64 MiB by default)
the two builds run alternately, `--rounds` times each, every run in fresh processes: warm-up, then
5 timed blocks of steady-state `dist.all_reduce` calls (about `--budget` seconds); a run's time is
its median block on the slowest rank. A row's figure is the median over its runs, and B/A above
1 means B is slower. On a shared 2-core machine one run swings by up to 2x (docs/benchmarks.md), so
single runs cannot answer this; interleaved medians can, to a few percent. Writes JSON.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def worker(size: int, dtype: str, budget: float) -> None:
    import json

    import torch
    import torch.distributed as dist

    import sdp_jupyter.torch  # noqa: F401  (registers smddp; from the tree on PYTHONPATH)
    from _spawn import agree

    dist.init_process_group("smddp")
    t = torch.ones(size // torch.empty(0, dtype=getattr(torch, dtype)).element_size(), dtype=getattr(torch, dtype))
    def agreed(count: float) -> int:  # every rank makes the same number of calls
        return max(3, int(agree(count)))

    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(t)
    per_call = (time.perf_counter() - t0) / 3
    for _ in range(agreed(0.1 / per_call)):  # warm-up for about 0.1 s: connections, first touch, caches
        dist.all_reduce(t)
    t0 = time.perf_counter()
    for _ in range(3):
        dist.all_reduce(t)
    n = agreed(budget / 5 / ((time.perf_counter() - t0) / 3))
    blocks = []
    for _ in range(5):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        blocks.append((time.perf_counter() - t0) / n)
    dist.destroy_process_group()
    print(json.dumps({"median_s": statistics.median(blocks), "sdp_jupyter": sdp_jupyter.__file__}))


def main() -> None:
    from _spawn import bench_parser, machine_info, run_ranks, write_results

    ap = bench_parser(__doc__)
    ap.add_argument("trees", nargs="*", help="BEFORE_TREE AFTER_TREE")
    ap.add_argument("--sizes", default=f"{4 << 10},{1 << 20},{64 << 20}", help="comma list of bytes")
    ap.add_argument("--dtypes", default="float32,float16")
    ap.add_argument("--rounds", type=int, default=4, help="runs of each build per row")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per run")
    ap.add_argument("--size", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "allreduce_ab.json"))
    a = ap.parse_args()
    if a.worker:
        worker(a.size, a.dtype, a.budget)
        return
    if len(a.trees) != 2:
        ap.error("give two source trees: BEFORE_TREE AFTER_TREE (each with its engine built in place)")
    trees = [os.path.abspath(t) for t in a.trees]
    for t in trees:
        if not os.path.isdir(os.path.join(t, "sdp_jupyter")):
            ap.error(f"{t} is not a checkout of sdp_jupyter (no sdp_jupyter/ folder in it)")
    info = machine_info()
    print(f"machine: {info['cpus']} cpus, single-core memcpy {info['memcpy_GBps']:.2f} GB/s, load {info['loadavg_1min']}")
    print(f"A = {trees[0]}\nB = {trees[1]}\nB/A above 1: B slower; {a.rounds} interleaved runs of each per row", flush=True)
    script = os.path.abspath(__file__)
    rows = []
    for layout, per_node in (("1 node", 2), ("1 rank/node", 1)):
        for dtype in a.dtypes.split(","):
            for size in (int(s) for s in a.sizes.split(",")):
                runs: dict[str, list[float]] = {"A": [], "B": []}
                for _ in range(a.rounds):
                    for name, tree in zip("AB", trees):
                        env = {"PYTHONPATH": tree + os.pathsep + os.environ.get("PYTHONPATH", "")}
                        res = run_ranks(script, 2, per_node, ["--size", str(size), "--dtype", dtype,
                                                              "--budget", str(a.budget)], extra_env=env)
                        bad = [r["sdp_jupyter"] for r in res if not r["sdp_jupyter"].startswith(tree + os.sep)]
                        if bad:
                            raise SystemExit(f"a rank imported sdp_jupyter from {bad[0]}, not from {tree}")
                        runs[name].append(max(r["median_s"] for r in res))
                ma, mb = statistics.median(runs["A"]), statistics.median(runs["B"])
                row = {"layout": layout, "dtype": dtype, "bytes": size, "A_us": ma * 1e6, "B_us": mb * 1e6,
                       "B_over_A": mb / ma, "A_runs_us": [x * 1e6 for x in runs["A"]],
                       "B_runs_us": [x * 1e6 for x in runs["B"]]}
                rows.append(row)
                print(f"{layout:12s} {dtype:8s} {size / 1024:>8.0f} KiB | A {row['A_us']:10.1f} us | "
                      f"B {row['B_us']:10.1f} us | B/A {row['B_over_A']:5.2f} | runs A "
                      f"{min(row['A_runs_us']):.0f}-{max(row['A_runs_us']):.0f}, B "
                      f"{min(row['B_runs_us']):.0f}-{max(row['B_runs_us']):.0f} us", flush=True)
    write_results(a.out, info, rows, trees=trees, rounds=a.rounds, budget_s=a.budget)


if __name__ == "__main__":
    main()
