"""The quickstart's training cell, cold and warm, against another commit: interleaved A/B.

    PYTHONPATH=. python benchmarks/warm_cell_ab.py                      # against aa67a00, 3 rounds
    PYTHONPATH=. python benchmarks/warm_cell_ab.py --against HEAD~5 --rounds 4 --json out.json

`./dev.sh main`'s cell (`%%sdp_train --nodes 4`, notebooks/01_quickstart.ipynb) timed by each tree's own
tools/main_job.py: a fresh kernel's first job (cold) and the same cell again in that kernel (warm, ranks
forked from the pool the first job started). The other commit is checked out in a worktree under
/tmp (kept for the next run) with its engine built in place (`setup.py build_ext --inplace`, a few
minutes the first time) and run with its own PYTHONPATH; both trees use this interpreter and its torch.
The trees alternate, which goes first swapping each round, so a load change on a shared machine falls
on both. Prints each run, a table of medians and the ratio this/other; writes JSON. Not a test.
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

from _spawn import machine_info, write_results  # noqa: E402

CELL = re.compile(r"training cell .*: cold ([\d.]+) s .*, warm ([\d.]+) s")


def worktree(commit: str) -> str:
    """A checkout of `commit` with its engine built in place (made once, reused)."""
    sha = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    path = f"/tmp/sdp-ab-{sha}"
    if not os.path.isdir(path):
        print(f"checking out {sha} into {path}", flush=True)
        subprocess.run(["git", "worktree", "add", "--detach", path, sha], cwd=REPO, check=True,
                       capture_output=True)
    if not any(name.startswith("_engine") and name.endswith(".so") for name in os.listdir(f"{path}/sdp_jupyter")):
        print(f"building {sha}'s engine in place (a few minutes on 2 cores) ...", flush=True)
        t0 = time.monotonic()
        p = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=path, capture_output=True,
                           text=True)
        if p.returncode != 0:
            sys.exit(f"building {sha}'s engine failed:\n{p.stderr[-3000:]}")
        print(f"built in {time.monotonic() - t0:.0f} s", flush=True)
    return path


def cell_times(tree: str, timeout: float) -> tuple[float, float]:
    """(cold, warm) seconds of the quickstart's training cell, as `tree`'s tools/main_job.py says them."""
    env = {**os.environ, "PYTHONPATH": tree}
    env.pop("SDP_JOBS_DIR", None)
    p = subprocess.run([sys.executable, "tools/main_job.py"], cwd=tree, env=env, capture_output=True, text=True,
                       timeout=timeout)
    m = CELL.search(p.stdout)
    if p.returncode != 0 or not m:
        sys.exit(f"tools/main_job.py in {tree} failed (exit {p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return float(m.group(1)), float(m.group(2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", default="aa67a00", help="the other commit (default aa67a00, before the third "
                                                         "pass of the house)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each tree (default 3)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one run may take (default 600)")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "warm_cell_ab.json"))
    args = ap.parse_args()

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    trees = {f"this tree ({head})": REPO, f"{args.against}": worktree(args.against)}
    info = machine_info()
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            cold, warm = cell_times(trees[name], args.timeout)
            times[name].append((cold, warm))
            print(f"round {r + 1}: {name:<22} cold {cold:5.1f} s  warm {warm:5.2f} s", flush=True)

    rows = []
    print(f"\n{'tree':<22} {'warm (median)':>14} {'cold (median)':>14}  runs (warm)")
    for name, runs in times.items():
        warm = statistics.median(w for _, w in runs)
        cold = statistics.median(c for c, _ in runs)
        rows.append({"tree": name, "warm_s": warm, "cold_s": cold, "runs": [{"cold_s": c, "warm_s": w} for c, w in runs]})
        print(f"{name:<22} {warm:>12.2f} s {cold:>12.1f} s  {', '.join(f'{w:.2f}' for _, w in runs)}")
    mine, other = rows
    print(f"\nthis/other: warm {mine['warm_s'] / other['warm_s']:.2f}, cold {mine['cold_s'] / other['cold_s']:.2f} "
          f"(below 1: this tree is faster); load {info['loadavg_1min']}")
    write_results(args.json, info, rows, against=args.against, head=head)


if __name__ == "__main__":
    main()
