"""Seconds from a failure to training again: an elastic job (`--nodes 2:3`) against a plain one with
`--max-restarts 1`, on the SSH test hosts, in the same run.

    sudo PYTHONPATH=. .venv/bin/python benchmarks/elastic.py [--rounds 3] [--scenarios ABCDE] [--out results/elastic.json]

It starts its own test hosts (sdp_jupyter.testing: Cluster(hosts=4), sshd on h1..h3, the "notebook" a
driver on h0; root needed) and stops them at the end, also on an exception or Ctrl-C. Every job runs
ELASTIC_TRAIN (tests/helpers/remote_jobs.py: a checkpoint saved every step, "attempt A world W from
step S" at each attempt's start, "step N loss L" after each step) on h1, h2, h3, one rank per node.
Once rank 0's log shows step K (K random in 5..15) the failure is injected:

  A  rank crash, elastic --nodes 2:3 --max-restarts 1: SIGKILL h3's rank (its agent stays)
  B  rank crash, plain   --nodes 3   --max-restarts 1: the same kill (the peer of A)
  C  node lost,  elastic --nodes 2:3: SIGKILL h3's agent and its rank (h3's sshd stays up)
  D  node lost,  plain   --nodes 3   --max-restarts 1: the same kill; a lost host is final there
  E  link cut,   elastic --nodes 2:3: cluster.cut(3); healed once the job trains again

The plain jobs (B, D) save their checkpoint in a --checkpoint-dir every host sees (the test hosts share
this machine's file system): without one, checkpoint.load() in a plain job reads each host's own copy,
so after a restart rank 0 resumed from its checkpoint while the ranks on h2 and h3, holding none,
started from step 0, and the job failed at the end (seen in a first run). An elastic job needs no
shared storage: every node keeps a copy and load() hands out node 0's.

"to training again": from the kill (or cut) until the benchmark, polling the job's logs/rank-0.log
every 50 ms, first sees a "step N" line after a later attempt's "attempt A" line. For a job that fails
instead (D), the seconds until the driver had the job's final state. "redone": completed steps run
again = the last step rank 0 had printed at the failure + 1 - the step the next attempt started from.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import json
import os
import random
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
from _spawn import bench_parser, machine_info, write_results  # noqa: E402
from helpers.chaos import ATTEMPT, DRIVER, STEP, rank_pids as _ranks, read_log as _read_log  # noqa: E402
from sdp_jupyter.testing.cluster import signal_all  # noqa: E402

SCENARIOS = {
    "A": ("rank crash, elastic 2:3, --max-restarts 1", {"nodes": "2:3", "max_restarts": 1}, "rank"),
    "B": ("rank crash, plain 3, --max-restarts 1", {"nodes": 3, "max_restarts": 1}, "rank"),
    "C": ("node lost, elastic 2:3", {"nodes": "2:3"}, "node"),
    "D": ("node lost, plain 3, --max-restarts 1", {"nodes": 3, "max_restarts": 1}, "node"),
    "E": ("link cut, elastic 2:3", {"nodes": "2:3"}, "cut"),
}

def _progress(lines: list[str]) -> tuple[int, int, int | None, bool]:
    """(the last attempt seen, its start step, the last step printed in it or None, a step printed in it)"""
    attempt, start, last = -1, 0, None
    for line in lines:
        if m := ATTEMPT.match(line):
            attempt, start, last = int(m[1]), int(m[3]), None
        elif m := STEP.match(line):
            last = int(m[1])
    return attempt, start, last, last is not None


def _line(proc, timeout: float) -> dict | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if not line:
                return None
            if line.startswith("{"):
                return json.loads(line)
    return None


def one_round(cluster, hosts, jobs: Path, key: str, i: int, rng: random.Random, steps: int, sleep: float) -> dict:
    title, spec, kind = SCENARIOS[key]
    at = rng.randint(5, 15)
    if not isinstance(spec["nodes"], str):  # a plain job: its checkpoint on storage every host sees (below)
        spec = {**spec, "checkpoint_dir": str(jobs.parent / "checkpoints" / f"el-{key}{i}")}
    args = {"target": "ssh", "ssh": {"hosts": hosts.hosts, "config": str(hosts.config)}, "jobs_dir": str(jobs),
            "name": f"el-{key}{i}", "procs_per_node": 1, "env": {"STEPS": str(steps), "STEP_SLEEP": str(sleep)},
            "code": __import__("helpers.remote_jobs", fromlist=["x"]).ELASTIC_TRAIN, **spec}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    t_launch = time.time()
    d = cluster.popen(0, [sys.executable, "-c", DRIVER, json.dumps(args)], env=env, text=True,
                      stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    row = {"scenario": key, "round": i, "fail_at_step": at}
    cut = False
    try:
        first = _line(d, 120)
        if not first or "dir" not in first:
            raise RuntimeError(f"the driver did not start the job: {d.stderr.read()[-2000:] if d.poll() is not None else ''}")
        log = Path(first["dir"]) / "logs" / "rank-0.log"
        deadline = time.monotonic() + 120
        while True:  # until rank 0 has printed step `at`
            attempt, start, last, _ = _progress(_read_log(log))
            if last is not None and last >= at:
                break
            if d.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job never reached step {at}: {d.stderr.read()[-2000:]}")
            time.sleep(0.02)
        if kind == "cut":
            t_fail = time.time()
            cluster.cut(3)
            cut = True
        else:
            if kind == "rank":  # the rank alone: its agent (and the monitor's sampler) stay
                pids = _ranks(hosts, 3)
            else:  # every rank-side process and the agent, as tests/launch/test_elastic.py kills a node
                pids = hosts.processes(3) + hosts.processes(3, "sdp_jupyter.launch.host.agent")
            t_fail = time.time()
            signal_all(pids, signal.SIGKILL)
            row["killed"] = len(pids)
        row["time_to_failure_from_launch_s"] = round(t_fail - t_launch, 2)
        fail_attempt, _, fail_step, _ = _progress(_read_log(log))
        row["last_step_at_failure"] = fail_step
        back = None
        deadline = time.monotonic() + 150
        while back is None and time.monotonic() < deadline:  # the next attempt's first step on rank 0
            attempt, start, last, stepped = _progress(_read_log(log))
            if attempt > fail_attempt and stepped:
                back = time.time() - t_fail
                row.update(back_s=round(back, 3), attempt=attempt, resumed_from=start,
                           redone=fail_step + 1 - start)
                break
            if d.poll() is not None:
                break
            time.sleep(0.05)
        if cut and back is not None:
            cluster.heal(3)
            cut = False
        out = _line(d, 240)
        if cut:
            cluster.heal(3)
            cut = False
        if out is None:
            raise RuntimeError(f"the driver said nothing at the end: {d.stderr.read()[-2000:] if d.poll() is not None else ''}")
        row.update(state=out["state"], error=(out["error"] or "").splitlines()[0] if out["error"] else None,
                   restarts=out["restarts"],
                   formations=[f.get("hosts") for f in out["membership"] if "hosts" in f],
                   job_s=round(out["t"] - t_launch, 2))
        if back is None:
            row["said_failed_s"] = round(out["t"] - t_fail, 3)
        return row
    finally:
        if cut:
            cluster.heal(3)
        if d.poll() is None:
            d.kill()
        d.wait()
        left = hosts.wait_clean(30)
        if left:
            for pids in left.values():
                signal_all(pids, signal.SIGKILL)
            row["leftovers"] = {str(k): len(v) for k, v in left.items()}


def _fmt(rows: list[dict]) -> dict:
    back = [r["back_s"] for r in rows if r.get("back_s") is not None]
    failed = [r for r in rows if r.get("state") != "succeeded"]
    redone = sorted({r["redone"] for r in rows if r.get("redone") is not None})
    restarts = sorted({r.get("restarts") for r in rows if "restarts" in r})
    if back:
        seconds = f"{statistics.median(back):.2f} / {max(back):.2f}"
    else:
        said = [r["said_failed_s"] for r in rows if r.get("said_failed_s") is not None]
        seconds = f"failed after {statistics.median(said):.2f} / {max(said):.2f}" if said else "-"
    if failed:
        errors = sorted({(r.get("error") or r.get("exception") or "?")[:70] for r in failed})
        outcome = f"{len(rows) - len(failed)} succeeded; failed: " + " | ".join(errors)
    else:
        outcome = f"{len(rows)} succeeded"
    return {"seconds": seconds, "median": statistics.median(back) if back else None,
            "said_failed_median": statistics.median([r["said_failed_s"] for r in rows if r.get("said_failed_s")])
            if any(r.get("said_failed_s") for r in rows) else None,
            "redone": ",".join(map(str, redone)) or "-", "restarts": ",".join(map(str, restarts)) or "-",
            "outcome": outcome}


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--scenarios", default="ABCDE")
    p.add_argument("--steps", type=int, default=25, help="STEPS of the training script")
    p.add_argument("--step-sleep", type=float, default=0.2, help="STEP_SLEEP: seconds each step sleeps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "elastic.json"))
    args = p.parse_args()
    from sdp_jupyter.testing.cluster import Cluster
    from sdp_jupyter.testing.sshd import SSHHosts

    rng = random.Random(args.seed)
    info = machine_info()
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="sdp-bench-elastic-"))
    os.chmod(root, 0o700)
    cluster = Cluster(hosts=4).start()
    hosts = None
    rows = []
    try:
        hosts = SSHHosts(cluster, root / "ssh")
        (root / "ssh").mkdir(mode=0o700)
        hosts.start()
        jobs = root / "jobs"
        order = [(k, i) for i in range(args.rounds) for k in args.scenarios]  # interleaved: a drift hits all alike
        for key, i in order:
            try:
                row = one_round(cluster, hosts, jobs, key, i, rng, args.steps, args.step_sleep)
            except Exception as e:  # noqa: BLE001 - a round that goes wrong is reported, the run goes on
                row = {"scenario": key, "round": i, "exception": f"{type(e).__name__}: {str(e)[:500]}"}
            rows.append(row)
            what = (f"back training in {row['back_s']:.2f} s (from step {row['resumed_from']}, "
                    f"{row['redone']} redone)" if row.get("back_s") is not None else
                    f"no new attempt; job said it ended after {row.get('said_failed_s')} s")
            print(f"{key} round {i}: failure at step {row.get('last_step_at_failure')}: {what}; "
                  f"{row.get('state', row.get('exception'))}, restarts {row.get('restarts')}, "
                  f"formations {row.get('formations')}", flush=True)
    finally:
        if hosts is not None:
            hosts.stop()
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)  # the job folders, keys and checkpoints
    total = time.monotonic() - t0
    summary = {}
    print(f"\n{'scenario':48s} {'rounds':>6s}  {'to training again: median / max s':36s} {'redone':>7s} "
          f"{'restarts':>8s}  outcome")
    for key in args.scenarios:
        mine = [r for r in rows if r["scenario"] == key]
        s = _fmt(mine)
        summary[key] = s
        print(f"{key}  {SCENARIOS[key][0]:45s} {len(mine):6d}  {s['seconds']:36s} {s['redone']:>7s} "
              f"{s['restarts']:>8s}  {s['outcome']}")
    ratios = {}
    if summary.get("C", {}).get("median") and summary.get("D", {}).get("said_failed_median"):
        ratios["C_back_over_D_failed"] = summary["C"]["median"] / summary["D"]["said_failed_median"]
        print(f"\nC vs D: the elastic job trains again {summary['C']['median']:.2f} s after losing h3; the plain job "
              f"reports failure after {summary['D']['said_failed_median']:.2f} s (ratio "
              f"{ratios['C_back_over_D_failed']:.2f}) and does not train again")
    if summary.get("A", {}).get("median") and summary.get("B", {}).get("median"):
        ratios["A_over_B"] = summary["A"]["median"] / summary["B"]["median"]
        print(f"A vs B: a rank crash costs {summary['A']['median']:.2f} s elastic against {summary['B']['median']:.2f} s "
              f"plain (A/B {ratios['A_over_B']:.2f})")
    print(f"{len(rows)} jobs in {total:.0f} s")
    write_results(args.out, info, rows, rounds=args.rounds, steps=args.steps, step_sleep=args.step_sleep,
                  seed=args.seed, total_s=round(total, 1), summary=summary, ratios=ratios,
                  scenarios={k: SCENARIOS[k][0] for k in args.scenarios})


if __name__ == "__main__":
    main()
