"""What notebook code by value costs (issue 62), each figure against its peer measured in the same run.

    PYTHONPATH=. python benchmarks/notebook_code.py [--nodes 2] [--reps 5] [--ranks 4] [--calls 40]
                                                   [--out benchmarks/results/notebook_code.json]

1. `sdp_jupyter.run(fn, nodes=N)` against the same work as a `%%sdp_train` cell (`launch(code=...,
   init_process_group=True)`, wait, `job.result()`: what the magic does), launch to result, cold
   (fresh interpreters) and warm (forked from the warm pool), alternating one of each per round.
   The work: a notebook function (a class of the notebook inside) that all_reduces one float.
2. `Session.apply(fn)` of a small notebook function on a `--ranks`-rank local session, against the
   `x = 1` cell on the same session (`Session.run`, what %%sdp_px waits for), alternating.
3. `--push` of a 100 MB float64 array: pickle_push as it is against the code before notebook code went
   by value (git show 00d83d2:sdp_jupyter/launch/kernel/push.py, loaded from git), alternating.

Figures are medians (and min/max) of the rounds. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

import __main__

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BEFORE = "00d83d2"  # the last commit whose --push refused notebook code

# the notebook's code: defined in __main__, so it goes by value as a notebook cell's does
NOTEBOOK = '''
class Scaler:
    def __init__(self, k):
        self.k = k
    def __call__(self, x):
        return x * self.k
def work(k):
    import torch, torch.distributed as dist
    t = torch.ones(1) * Scaler(k)(dist.get_rank() + 1)
    dist.all_reduce(t)
    return t.item()
def small(x):
    return x + 1
'''
CELL = ("import torch, torch.distributed as dist\n"
        "t = torch.ones(1) * (dist.get_rank() + 1) * 2\n"
        "dist.all_reduce(t)\n"
        "t.item()\n")


def _stats(xs: list) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def bench_run(nodes: int, reps: int, jobs: str) -> dict:
    import sdp_jupyter

    out = {}
    for start in ("cold", "warm"):
        fields = dict(nodes=nodes, backend="gloo", start=start, jobs_dir=jobs)
        sdp_jupyter.run(__main__.work, args=(2,), **fields)  # warm-up (and the warm pool started)
        times = {"run(fn)": [], "%%sdp_train cell": []}
        for _ in range(reps):
            t0 = time.perf_counter()
            values = sdp_jupyter.run(__main__.work, args=(2,), wait=False, **fields)
            values.wait()
            got = values.result()
            times["run(fn)"].append(time.perf_counter() - t0)
            assert got == [2.0 * sum(range(1, nodes + 1))] * nodes, got
            t0 = time.perf_counter()
            job = sdp_jupyter.launch(code=CELL, init_process_group=True, **fields)
            job.wait()
            job.result()
            times["%%sdp_train cell"].append(time.perf_counter() - t0)
        out[start] = {k: _stats(v) for k, v in times.items()}
        out[start]["ratio"] = out[start]["run(fn)"]["median"] / out[start]["%%sdp_train cell"]["median"]
    return out


def bench_apply(ranks: int, calls: int) -> dict:
    from sdp_jupyter.launch.kernel import session
    from sdp_jupyter.launch.spec import JobSpec

    s = session.start(JobSpec(code="pass", nodes=ranks), as_current=False)
    try:
        s.run("x = 1")
        s.apply(__main__.small, 1)
        times = {"apply(small)": [], "x = 1 cell": []}
        for _ in range(calls):
            t0 = time.perf_counter()
            assert s.apply(__main__.small, 1) == [2] * ranks
            times["apply(small)"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.run("x = 1")
            times["x = 1 cell"].append(time.perf_counter() - t0)
    finally:
        s.stop()
    out = {k: _stats([x * 1000 for x in v]) for k, v in times.items()}  # milliseconds
    out["ratio"] = out["apply(small)"]["median"] / out["x = 1 cell"]["median"]
    return out


def _push_before():
    """The --push pickling of BEFORE, loaded from git (a module of its own)."""
    source = subprocess.run(["git", "show", f"{BEFORE}:sdp_jupyter/launch/kernel/push.py"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout
    module = types.ModuleType("push_before")
    exec(compile(source, "push_before.py", "exec"), module.__dict__)
    return module.pickle_push


def bench_push(reps: int) -> dict:
    import numpy as np

    from sdp_jupyter.launch.kernel.push import pickle_push

    before = _push_before()
    values = {"X": np.random.default_rng(0).random(100 * 2 ** 20 // 8)}  # 100 MiB of float64
    times = {"now": [], "before": []}
    for _ in range(reps):
        for label, fn in (("now", pickle_push), ("before", before)):
            t0 = time.perf_counter()
            fn(["X"], values)
            times[label].append(time.perf_counter() - t0)
    out = {k: _stats(v) for k, v in times.items()}
    out["ratio"] = out["now"]["median"] / out["before"]["median"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "notebook_code.json"))
    args = p.parse_args(argv)
    exec(compile(NOTEBOOK, "<notebook>", "exec"), __main__.__dict__)
    results = {"machine": f"{os.cpu_count()} cores", "when": time.strftime("%Y-%m-%d %H:%M")}
    with tempfile.TemporaryDirectory() as jobs:
        results["push_100MB_s"] = bench_push(args.reps)
        results["apply_ms"] = bench_apply(args.ranks, args.calls)
        results["run_s"] = bench_run(args.nodes, args.reps, jobs)
    print(f"{'what':44} {'ours':>10} {'peer':>10} {'ratio':>7}")
    push = results["push_100MB_s"]
    print(f"{'--push 100 MB array (s): now vs before':44} {push['now']['median']:10.3f} "
          f"{push['before']['median']:10.3f} {push['ratio']:7.2f}")
    ap = results["apply_ms"]
    print(f"{f'apply(small) vs x = 1 cell, {args.ranks} ranks (ms)':44} {ap['apply(small)']['median']:10.2f} "
          f"{ap['x = 1 cell']['median']:10.2f} {ap['ratio']:7.2f}")
    for start, r in results["run_s"].items():
        print(f"{f'run(fn) vs %%sdp_train cell, {start} (s)':44} {r['run(fn)']['median']:10.3f} "
              f"{r['%%sdp_train cell']['median']:10.3f} {r['ratio']:7.2f}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
