"""Kill a rank at a random moment, many times: does every survivor notice, fast, and name the right rank?

Each round starts 4 ranks of the smddp engine (sdp_jupyter.comm) that run a random but rank-agreed mix of
all_reduce (16 B to 4 MiB), broadcast, all_gather, barrier and an isend/irecv ring. Once every rank has
run its warm-up operations, the driver waits a random moment and SIGKILLs one random rank (or, with
--stop, freezes it with SIGSTOP). It then measures, per survivor, the lag from the kill to its error,
and whether that error names the dead rank (and, across test hosts, its host) and not a rank that
only left because of it. A survivor still running `--hang-after` seconds after the kill is a hang
(its stacks are dumped into the round's log, kept under --keep).

Layouts: 1x4, 2x2 and 4x1 (nodes x ranks per node) on this machine, and 2x2h: 2 test hosts x 2 ranks
(network namespaces, sdp_jupyter.testing.cluster; needs root). With --stop the frozen rank must be named
at the deadline (SDP_TIMEOUT=--deadline) and the flight recorder's analyser (sdp_jupyter.flight) must say
it made no progress, with the operation it was last seen in.

    python benchmarks/kill_stress.py --rounds 100                 # 100 rounds over 1x4, 2x2, 4x1
    sudo python benchmarks/kill_stress.py --rounds 1000 --layouts 1x4,2x2,4x1,2x2h
    python benchmarks/kill_stress.py --rounds 6 --stop            # SIGSTOP instead of SIGKILL

Prints a table per layout (rounds, hangs, wrong names, lag p50/p99/max) and writes results/kill_stress.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from _spawn import free_port, rank_env  # noqa: E402
WORLD = 4


# ---------------------------------------------------------------------------------------------- a rank
def worker(seed: int, warmup: int, ready_path: str, ring: bool = True) -> int:
    import faulthandler

    import numpy as np

    from sdp_jupyter import comm

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the driver asks a hung rank for its stacks
    c = comm.init()
    rank, world = c.rank, c.world_size
    rng = random.Random(seed)  # the same sequence on every rank: they call the same operations
    bufs: dict[int, np.ndarray] = {}

    def buf(n: int) -> np.ndarray:
        if n not in bufs:
            bufs[n] = np.ones(n, dtype=np.float32)
        return bufs[n]

    ring_out, ring_in = np.ones(1024, np.float32), np.empty(1024, np.float32)
    gather_out = np.empty(world * 4096, np.float32)
    i = 0
    try:
        while True:
            kind = rng.choice(("all_reduce", "all_reduce", "broadcast", "all_gather", "barrier") + (("ring",) if ring else ()))
            if kind == "all_reduce":
                c.all_reduce(buf(4 << rng.randrange(0, 19)))  # 4 .. 2^20 float32: 16 B to 4 MiB
            elif kind == "broadcast":
                c.broadcast(buf(1 << rng.randrange(2, 16)), root=rng.randrange(world))
            elif kind == "all_gather":
                n = 1 << rng.randrange(2, 12)
                c.all_gather(gather_out[:world * n], buf(n))
            elif kind == "barrier":
                c.barrier()
            else:
                s = c.send(ring_out, (rank + 1) % world, tag=i, async_op=True)
                r = c.recv(ring_in, (rank - 1) % world, tag=i, async_op=True)
                s.wait()
                r.wait()
            i += 1
            if i == warmup:
                with open(f"{ready_path}.{rank}", "w") as f:
                    f.write(str(time.time()))
    except comm.SmddpError as exc:
        print(json.dumps({"rank": rank, "error": str(exc), "t": time.time(), "ops": i}), flush=True)
        return 3


# ---------------------------------------------------------------------------------------------- the driver
LAYOUTS = {"1x4": (1, 4), "2x2": (2, 2), "4x1": (4, 1), "2x2h": (2, 2)}


def _names(err: str, victim: int, host: tuple | None) -> bool:
    """Whether an error names the victim rank (and, across test hosts, its host's name or address)."""
    import re

    if not re.search(rf"\brank(?:\(s\))? (?:\d+, )*{victim}\b", err):
        return False
    return host is None or any(re.search(rf"\b{re.escape(h)}\b", err) for h in host)


def one_round(layout: str, n: int, args, cluster, tmp: str) -> dict:
    nodes, per_node = LAYOUTS[layout]
    seed = secrets.randbelow(1 << 30)
    # a free port here; on the test hosts any port of the first host's own (empty) network namespace
    port = 20000 + secrets.randbelow(10000) if cluster else free_port()
    secret = secrets.token_hex(16)
    ready = os.path.join(tmp, f"ready-{n}")
    flight_dir = os.path.join(tmp, f"flight-{n}")
    procs, logs = [], []
    for r in range(WORLD):
        node = r // per_node
        env = rank_env(r, WORLD, per_node, port, secret, addr=cluster.addresses[0] if cluster else "127.0.0.1", extra={
            "SDP_TIMEOUT": str(args.deadline), "SDP_FLIGHT_DIR": flight_dir, "SDP_HANG_WARN_S": "1",
            "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))})
        env.pop("SDP_JOB_DIR", None)
        log = open(os.path.join(tmp, f"round-{n}-rank-{r}.log"), "w+")
        argv = [sys.executable, __file__, "--worker", "--seed", str(seed), "--warmup", str(args.warmup), "--ready", ready]
        if args.stop:
            argv.append("--no-ring")
        if cluster:
            procs.append(cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        else:
            procs.append(subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
        logs.append(log)
    result = {"layout": layout, "round": n, "seed": seed}
    try:
        t0 = time.monotonic()
        while not all(os.path.exists(f"{ready}.{r}") for r in range(WORLD)):
            if time.monotonic() - t0 > 60 or any(p.poll() is not None for p in procs):
                result["setup_failed"] = True
                return result
            time.sleep(0.01)
        victim = random.randrange(WORLD)
        # a frozen rank is named with where it was last seen: give each rank time for its first flight line
        time.sleep(random.uniform(1.5, 1.5 + args.max_delay) if args.stop else random.uniform(0, args.max_delay))
        t_kill = time.time()
        os.kill(procs[victim].pid, signal.SIGSTOP if args.stop else signal.SIGKILL)
        h = victim // per_node
        result.update(victim=victim, victim_host=(cluster.hostnames[h], cluster.addresses[h]) if cluster else None)
        deadline = time.monotonic() + args.hang_after + (args.deadline if args.stop else 0)
        for r, p in enumerate(procs):
            if r == victim:
                continue
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        hung = [r for r, p in enumerate(procs) if r != victim and p.poll() is None]
        for r in hung:
            os.kill(procs[r].pid, signal.SIGUSR1)  # faulthandler: stacks into the log
        if hung:
            time.sleep(1.0)
        result["hung"] = hung
        survivors = {}
        for r, log in enumerate(logs):
            if r == victim:
                continue
            log.seek(0)
            lines = [ln for ln in log.read().splitlines() if ln.startswith("{")]
            if lines:
                d = json.loads(lines[-1])
                survivors[r] = {"lag": d["t"] - t_kill, "error": d["error"],
                                "names": _names(d["error"], victim, result["victim_host"])}
        result["survivors"] = survivors
        from sdp_jupyter import flight  # the analyser's sentence from the rings the survivors wrote

        exits = None if args.stop else {victim: -signal.SIGKILL}
        result["analysis"] = flight.analyse(flight_dir, exits=exits).sentence
        result["analysis_ok"] = bool(result["analysis"]) and _names(result["analysis"], victim, None) and \
            ("no progress" if args.stop else "died") in result["analysis"]
        return result
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except OSError:
                pass
            try:
                os.kill(p.pid, signal.SIGCONT)
            except OSError:
                pass
            p.wait()
        for log in logs:
            log.close()
        ok = not result.get("hung") and all(s["names"] for s in result.get("survivors", {}).values()) and \
            result.get("analysis_ok", True)
        if ok and not result.get("setup_failed"):
            for r in range(WORLD):
                for path in (f"{ready}.{r}", os.path.join(tmp, f"round-{n}-rank-{r}.log")):
                    try:
                        os.unlink(path)
                    except OSError:
                        pass
            shutil.rmtree(flight_dir, ignore_errors=True)


def pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def summarize(results: list[dict]) -> list[dict]:
    rows = []
    for layout in dict.fromkeys(r["layout"] for r in results):
        rs = [r for r in results if r["layout"] == layout]
        lags = [s["lag"] for r in rs for s in r.get("survivors", {}).values()]
        rows.append({
            "layout": layout, "rounds": len(rs), "setup_failed": sum(1 for r in rs if r.get("setup_failed")),
            "hangs": sum(1 for r in rs if r.get("hung")),
            "survivors": len(lags),
            "wrong_name": sum(1 for r in rs for s in r.get("survivors", {}).values() if not s["names"]),
            "lag_p50": pct(lags, 50), "lag_p99": pct(lags, 99), "lag_max": max(lags) if lags else float("nan"),
            "analysis_wrong": sum(1 for r in rs if "analysis_ok" in r and not r["analysis_ok"]),
        })
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--ready", default="", help=argparse.SUPPRESS)
    ap.add_argument("--warmup", type=int, default=30, help="operations every rank runs before the kill may come")
    ap.add_argument("--rounds", type=int, default=30, help="rounds in all, spread over the layouts")
    ap.add_argument("--layouts", default="1x4,2x2,4x1", help="comma-separated: 1x4, 2x2, 4x1, 2x2h (test hosts)")
    ap.add_argument("--max-delay", type=float, default=0.5, help="the kill comes up to this many seconds after set-up")
    ap.add_argument("--hang-after", type=float, default=10.0, help="a survivor still running this long after the kill hangs")
    ap.add_argument("--deadline", type=float, default=60.0, help="SDP_TIMEOUT of the ranks (--stop: keep it short)")
    ap.add_argument("--stop", action="store_true", help="freeze the victim with SIGSTOP instead of killing it (the mix "
                    "then has no isend/irecv ring: messages are not in the flight recorder, and in a ring each "
                    "receive times out at its own deadline naming the peer it waited for)")
    ap.add_argument("--no-ring", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--keep", default="", help="keep the logs of bad rounds in this folder")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "kill_stress.json"))
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.seed, args.warmup, args.ready, ring=not args.no_ring)
    if args.stop and args.deadline > 30:
        args.deadline = 5.0
    layouts = args.layouts.split(",")
    for name in layouts:
        if name not in LAYOUTS:
            ap.error(f"--layouts: {name!r} is not one of {', '.join(LAYOUTS)}")
    cluster = None
    if any(name.endswith("h") for name in layouts):
        from sdp_jupyter.testing.cluster import Cluster

        cluster = Cluster(hosts=2, rate=None).start()
    tmp = args.keep or tempfile.mkdtemp(prefix="sdp-kill-stress-")
    os.makedirs(tmp, exist_ok=True)
    results = []
    started = time.monotonic()
    try:
        for n in range(args.rounds):
            layout = layouts[n % len(layouts)]
            r = one_round(layout, n, args, cluster if layout.endswith("h") else None, tmp)
            results.append(r)
            bad = r.get("hung") or any(not s["names"] for s in r.get("survivors", {}).values()) or \
                r.get("setup_failed") or ("analysis_ok" in r and not r["analysis_ok"])
            if bad:
                print(f"round {n} ({layout}, victim {r.get('victim')}): {json.dumps(r)[:1500]}", flush=True)
            elif (n + 1) % 10 == 0:
                print(f"... {n + 1}/{args.rounds} rounds, {time.monotonic() - started:.0f} s", flush=True)
    finally:
        if cluster is not None:
            cluster.close()
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = summarize(results)
    print(f"\n{'layout':8} {'rounds':>6} {'hangs':>5} {'wrong':>5} {'lag p50':>8} {'p99':>7} {'max':>7}"
          + "  analysis wrong")
    for row in rows:
        print(f"{row['layout']:8} {row['rounds']:6} {row['hangs']:5} {row['wrong_name']:5} {row['lag_p50']:8.3f} "
              f"{row['lag_p99']:7.3f} {row['lag_max']:7.3f}  {row['analysis_wrong']}")
    total = time.monotonic() - started
    print(f"{len(results)} rounds ({'SIGSTOP' if args.stop else 'SIGKILL'}) in {total:.0f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"signal": "SIGSTOP" if args.stop else "SIGKILL", "seconds": total, "rows": rows,
                   "bad_rounds": [r for r in results if r.get("hung") or r.get("setup_failed") or
                                  any(not s["names"] for s in r.get("survivors", {}).values())]}, f, indent=1)
    return 1 if any(row["hangs"] or row["wrong_name"] or row["analysis_wrong"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
