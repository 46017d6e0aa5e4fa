"""Shared by the benchmarks: start W ranks of this machine as `nodes` x `per_node`, collect JSON."""
from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from sdp_jupyter._net import free_port


def bench_parser(doc: str):
    """The parser every smddp-vs-gloo benchmark starts from: its docstring as help, the hidden
    --worker flag (a rank) and --backend (the backend a rank runs)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--backend", default="smddp")
    return ap


def rank_env(rank: int, world: int, per_node: int, port: int, secret: str, addr: str = "127.0.0.1",
             extra: dict | None = None) -> dict:
    """Rank `rank`'s environment: this process's, torchrun's variables (the ranks of a node next to
    each other, `per_node` per node, rank 0's node at `addr`), the job secret, then `extra`."""
    env = dict(os.environ)
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank % per_node),
                "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(rank // per_node),
                "MASTER_ADDR": addr, "MASTER_PORT": str(port), "SDP_JOB_SECRET": secret})
    env.update(extra or {})
    return env


def run_ranks(script: str, world: int, per_node: int, args: list[str], timeout: float = 1800,
              extra_env: dict | None = None) -> list[dict]:
    """Run `python script --worker ARGS` as `world` ranks; each prints one JSON line at the end."""
    port, secret = free_port(), secrets.token_hex(16)
    procs = []
    tmp = tempfile.mkdtemp(prefix="sdp-bench-")
    for r in range(world):
        env = rank_env(r, world, per_node, port, secret, extra={"OMP_NUM_THREADS": "1", **(extra_env or {})})
        out = open(os.path.join(tmp, f"{r}.out"), "w+")
        procs.append((subprocess.Popen([sys.executable, script, "--worker", *args], stdout=out,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True), out))
    results = []
    failed = []
    for r, (p, out) in enumerate(procs):
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        out.seek(0)
        text = out.read()
        lines = [ln for ln in text.splitlines() if ln.startswith("{")]
        if p.returncode != 0 or not lines:
            failed.append(f"rank {r} exited {p.returncode}:\n{text[-2000:]}")
        else:
            results.append(json.loads(lines[-1]))
    for _, out in procs:
        out.close()
    shutil.rmtree(tmp, ignore_errors=True)  # every run makes one: hundreds piled up in /tmp
    if failed:
        raise RuntimeError("\n".join(failed))
    return results


def one_rank_per_node(world: int) -> list[tuple[str, int]]:
    """Layouts (name, ranks per node): all ranks on one node; one rank per node."""
    return [("1 node", world), ("1 rank/node", 1)]


def two_nodes(world: int) -> list[tuple[str, int]]:
    """Layouts (name, ranks per node): all ranks on one node; two nodes of world/2 ranks each."""
    return [("1 node", world), ("2 nodes", max(1, world // 2))]


def backend_runs(script: str, ranks: list[int], args: list[str], backends=("smddp", "gloo"),
                 layouts=one_rank_per_node):
    """For each world size in `ranks` and each layout `layouts(world)` gives: (world, layout,
    {backend: its ranks' results}), the backends run in turn with `--backend B ARGS`."""
    for world in ranks:
        for layout, per_node in layouts(world):
            yield world, layout, {b: run_ranks(script, world, per_node, ["--backend", b, *args]) for b in backends}


def agree(value: float) -> float:
    """The largest `value` over the ranks of torch.distributed's default group: from it every rank
    derives the same number of calls (collectives whose count differs between ranks mismatch)."""
    import torch
    import torch.distributed as dist

    a = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(a, op=dist.ReduceOp.MAX)
    return a.item()


def agreed_iterations(fn, budget: float, agree, cap: int = 100) -> int:
    """How many calls of fn fill about `budget` seconds (3..cap), from one timed call, the same on
    every rank (agree: the largest first time over the ranks)."""
    import time

    t0 = time.perf_counter()
    fn()
    return int(min(cap, max(3, budget / max(agree(time.perf_counter() - t0), 1e-6))))


def call_times(fn, budget: float, agree) -> tuple[float, float]:
    """(median time of one call, mean time per call over the whole timed loop) in seconds, after a
    warm-up; the iteration count (3..100, about `budget` seconds) comes from agree(first time),
    which must give every rank the same number. Calls run back to back, so where one call's work
    can spill into the next (a send that returns before its bytes arrive), the median can hide
    what the mean, the throughput of a stream of calls, shows."""
    import time

    fn()  # warm-up: connections, first touch
    iters = agreed_iterations(fn, budget, agree)
    times = []
    start = time.perf_counter()
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    total = time.perf_counter() - start
    times.sort()
    return times[len(times) // 2], total / iters


def timed(fn, reps: int, warmup: int = 1):
    """(median seconds of one call of fn over `reps` timed calls, what the last call returned), after
    `warmup` untimed calls (first touch, connections). One process: no agreement between ranks."""
    import time

    for _ in range(warmup):
        fn()
    times, last = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2], last


def median_time(fn, budget: float, agree) -> float:
    """fn's median time in seconds (see call_times)."""
    return call_times(fn, budget, agree)[0]


def slowest(results: list[dict], i: int, key: str) -> float:
    """Row i's `key` on the slowest rank: a collective ends when its last rank is done."""
    return max(o["rows"][i][key] for o in results)


def read_text(path: str) -> str | None:
    """A small file's text, stripped; None when it is missing, unreadable or empty (a file another
    process writes by rename, polled)."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def write_results(path: str, info: dict, rows: list[dict], **extra) -> None:
    """The benchmark's JSON: the machine, the command line, `extra` fields and the rows."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"machine": info, "command": " ".join(sys.argv), **extra, "rows": rows}, f, indent=1)
    print(f"results: {path}")


def machine_info() -> dict:
    import platform

    import numpy as np

    a = np.ones(64 << 18, dtype=np.float32)  # 64 MiB
    b = np.empty_like(a)
    import time
    best = 1e9
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(b, a)
        best = min(best, time.perf_counter() - t0)
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "memcpy_GBps": a.nbytes / best / 1e9, "loadavg_1min": load}
