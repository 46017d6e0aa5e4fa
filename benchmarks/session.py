"""Round trip of a cell on a 4-rank interactive session, against ipyparallel's %%px, in the same run.

    PYTHONPATH=. python benchmarks/session.py [--ranks 4] [--rounds 5] [--reps 40] [--out results/session.json]

"sdp session": `Session.run(code)` (what %%sdp_px waits for, without the magic's output streaming)
from the call until every rank's answer is back, on a local session started with
`session.start(JobSpec(code="pass", nodes=4))` (smddp). "ipyparallel": `rc[:].execute(code,
block=True)` on an `ipp.Cluster(n=4)` of this machine, whose engines made a torch.distributed gloo
group (the usual way to run DDP under %%px; ipyparallel has no collective of its own). Two cells:
`x = 1`, and one all_reduce of 4 KiB (1024 float32) over each side's default group. "in cell" is the
slowest rank's time inside the cell as that side measures it (the rest is the way there and back).

Both run side by side, in `--rounds` alternating blocks of `--reps` cells each (the machine's load
drifts; alternating keeps the two comparable), after a warm-up; figures are the median and p90 over
every cell. A third row times `x = 1` sent 1.5 s after the last cell, `--idle-reps` times per side,
alternating: a person's cells come seconds apart (a session's rank waits for its next cell in a
blocking read on its connection to the node's agent, launch/host/session_relay.py). A fourth row times
the same with the other side not running ("alone": ours before ipyparallel's cluster starts,
ipyparallel's after our session stops): on a 2-core machine each side's idle processes slow the
other's first cell after a pause. Without ipyparallel (pip install ipyparallel) ours is
measured and printed alone.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # _spawn, also when run with runpy
# (label, code, seconds idle before each cell: 0 for cells back to back)
CASES = [("empty cell (x = 1)", "x = 1", 0.0), ("all_reduce 4 KiB", "dist.all_reduce(t)", 0.0),
         ("x = 1 after 1.5 s idle", "x = 1", 1.5)]
ALONE = ("x = 1 after 1.5 s idle, alone", "x = 1", 1.5)  # measured with the other side not running
SETUP = "import torch, torch.distributed as dist\nt = torch.ones(1024)  # 4 KiB of float32"
PAUSE = 1.2  # seconds between blocks (the machine settles; the same for both sides)


class Ours:
    name = "sdp session"

    def __init__(self, ranks: int):
        from sdp_jupyter.launch.kernel import session
        from sdp_jupyter.launch.spec import JobSpec

        t0 = time.perf_counter()
        self.session = session.start(JobSpec(code="pass", nodes=ranks))
        self.start_s = time.perf_counter() - t0
        self.cell(SETUP)

    def cell(self, code: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        result = self.session.run(code)
        dt = time.perf_counter() - t0
        if result.failed:
            raise SystemExit(f"the session's cell failed: {result.message()}")
        return dt, max(a.get("seconds", 0.0) for a in result.answers.values())

    def close(self) -> None:
        self.session.stop()


class Ipp:
    name = "ipyparallel"

    def __init__(self, ipp, ranks: int):
        from sdp_jupyter._net import free_port

        self.version = ipp.__version__
        t0 = time.perf_counter()
        self.cluster = ipp.Cluster(n=ranks, log_level=40)
        self.rc = self.cluster.start_and_connect_sync(activate=False)
        self.rc.wait_for_engines(ranks, timeout=120)
        self.view = self.rc[:]
        self.view.scatter("rank", list(range(ranks)), flatten=True, block=True)
        self.view.execute(f"import torch.distributed as dist\ndist.init_process_group('gloo', "
                          f"init_method='tcp://127.0.0.1:{free_port()}', rank=rank, world_size={ranks})",
                          block=True).get()
        self.start_s = time.perf_counter() - t0
        self.cell(SETUP)

    def cell(self, code: str) -> tuple[float, float]:
        t0 = time.perf_counter()
        ar = self.view.execute(code, block=True)
        dt = time.perf_counter() - t0
        ar.get()  # raises the engines' error, if any
        return dt, max((m["completed"] - m["started"]).total_seconds() for m in ar.metadata)

    def close(self) -> None:
        self.view.execute("dist.destroy_process_group()", block=True)
        self.rc.close()
        self.cluster.stop_cluster_sync()


def figures(samples: list[float]) -> dict:
    return {"median_ms": statistics.median(samples) * 1e3, "p90_ms": statistics.quantiles(samples, n=10)[8] * 1e3}


def main() -> int:
    import argparse

    from _spawn import machine_info, write_results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5, help="alternating blocks per side and cell")
    ap.add_argument("--reps", type=int, default=40, help="cells per block")
    ap.add_argument("--idle-reps", type=int, default=20, help="cells per side sent after 1.5 s idle")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "session.json"))
    a = ap.parse_args()
    os.environ.setdefault("SDP_JOBS_DIR", tempfile.mkdtemp(prefix="sdp-session-bench-"))
    info = machine_info()
    print(f"machine: {info['cpus']} cpus, load {info['loadavg_1min']}", flush=True)
    sides = [Ours(a.ranks)]
    samples = {}
    closed = set()

    def cells(side, case, code, idle, rounds, reps):
        trip, inside = samples.setdefault((side.name, case), ([], []))
        for _ in range(rounds):
            time.sleep(idle or PAUSE)
            for _ in range(reps):
                dt, cell_s = side.cell(code)
                trip.append(dt)
                inside.append(cell_s)

    def alone(side):
        for _ in range(a.warmup):
            side.cell(ALONE[1])
        cells(side, ALONE[0], ALONE[1], ALONE[2], a.idle_reps, 1)

    try:
        import ipyparallel as ipp
    except ImportError:
        ipp = None
    peer = None if ipp else "ipyparallel is not installed (pip install ipyparallel): only the session is measured"
    try:
        alone(sides[0])  # before the peer's cluster exists
        if peer is None:
            sides.append(Ipp(ipp, a.ranks))
        for side in sides:
            print(f"{side.name}: {a.ranks} ranks started in {side.start_s:.2f} s", flush=True)
        if peer:
            print(peer, flush=True)
        for case, code, idle in CASES:
            for side in sides:
                for _ in range(a.warmup):
                    side.cell(code)
            rounds, reps = (a.idle_reps, 1) if idle else (a.rounds, a.reps)
            for _ in range(rounds):
                for side in sides:
                    cells(side, case, code, idle, 1, reps)
        if peer is None:
            sides[0].close()  # ours stops: the peer's first cells after a pause, alone
            closed.add(sides[0].name)
            alone(sides[1])
    finally:
        for side in sides:
            if side.name not in closed:
                side.close()
    rows = []
    print(f"\n{a.ranks} ranks, {a.rounds} x {a.reps} cells back to back, {a.idle_reps} after idle, per side (ms)")
    print(f"{'cell':31s} {'side':12s} {'median':>8} {'p90':>8} {'in cell':>8} {'vs ours':>8}")
    for case, _, _ in CASES + [ALONE]:
        ours = None
        for side in sides:
            trip, inside = samples[(side.name, case)]
            row = {"cell": case, "side": side.name, "ranks": a.ranks, "n": len(trip), **figures(trip),
                   "in_cell_median_ms": statistics.median(inside) * 1e3}
            ours = ours or row
            row["median_over_ours"] = row["median_ms"] / ours["median_ms"]
            rows.append(row)
            print(f"{case:31s} {side.name:12s} {row['median_ms']:8.3f} {row['p90_ms']:8.3f} "
                  f"{row['in_cell_median_ms']:8.3f} {'x%.2f' % row['median_over_ours']:>8}", flush=True)
    load_after = os.getloadavg()[0]
    print(f"load after: {load_after:.2f}")
    extra = {"ranks": a.ranks, "rounds": a.rounds, "reps": a.reps, "idle_reps": a.idle_reps,
             "loadavg_1min_after": load_after,
             "start_s": {s.name: round(s.start_s, 2) for s in sides},
             "ipyparallel": getattr(sides[-1], "version", None) if peer is None else peer}
    write_results(a.out, info, rows, **extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
