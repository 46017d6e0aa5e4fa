"""A session through faults: 200 cells on a 4-rank interactive session on the SSH test hosts while ranks are
killed and frozen and a host is lost. Does every cell either succeed or fail naming its cause, and do the
survivors keep their variables?

    sudo PYTHONPATH=. .venv/bin/python benchmarks/session_chaos.py [--cells 200] [--seed 0]
                                                                   [--out results/session_chaos.json]

It starts its own test hosts (sdp_jupyter.testing: Cluster(hosts=4), sshd on h1..h3; the notebook is a
driver on h0, root needed): a session of 2 nodes x 2 ranks on h1 and h2, smddp. A setup cell gives every
rank `kept` (its rank times 7) and a counter. Each cell runs 20 all_reduces, 20 ms apart, and then counts
itself on every rank (0.4 s). Every 5-12 cells (seeded) a fault lands at a random moment inside a cell:

  rank-kill  SIGKILL a random rank (rank 0 included): the cell fails naming it, the session starts it again
  rank-stop  SIGSTOP a random rank: its agent kills it after SDP_STOPPED_RANK_S (3 s here), then as above
  host-kill  once, at the middle cell: SIGKILL h2's agent and ranks; the cell fails naming the lost host,
             the next is refused until `shrink`, which the driver then calls (as the error tells a user)

After each failed cell the driver checks the session the way a user would look: one cell on every rank
returns `kept`, the counter and `sdp_replaced`. The survivors must still have their `kept` and a counter
that never went back; a started-again rank has `sdp_replaced` true and no `kept` (the driver gives it its
setup again, ranks=[r]). A cell counts as "lost to a fault" when it failed; as "unexplained" when it failed
without naming the rank the fault hit, or took longer than 120 s. At the end, no process on any host.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import json
import os
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
from helpers.remote_jobs import next_line, tell  # noqa: E402
from sdp_jupyter.testing.cluster import signal_all  # noqa: E402

# The notebook on h0. It injects the rank faults itself (the test hosts share this machine's process ids)
# and asks the benchmark for the host's loss (JSON lines out, a line in when done).
DRIVER = r'''
import json, os, random, signal, sys, threading, time
from sdp_jupyter.launch import JobSpec
from sdp_jupyter.launch.kernel import session as sessions
say = lambda **kw: print(json.dumps(kw), flush=True)
args = json.loads(sys.argv[1])
rng, cells = random.Random(args.pop("seed")), args.pop("cells")
s = sessions.start(JobSpec(code="pass", nodes=2, procs_per_node=2, env={"SDP_STOPPED_RANK_S": "3"}, **args))
SETUP = "import time, torch, torch.distributed as dist\nkept = dist.get_rank() * 7\ncount = 0\n"
CELL = ("t = torch.ones(256)\nfor _ in range(20):\n    dist.all_reduce(t)\n    time.sleep(0.02)\n"
        "count += 1\n")
LOOK = ("import torch.distributed as dist\n"  # a started-again rank has run no import yet
        "(globals().get('kept'), globals().get('count'), sdp_replaced, dist.get_world_size())")
s.run(SETUP)
say(ready=list(s.members))
counts = {r: 0 for r in s.members}
rows, next_fault, host_cell = [], rng.randint(5, 12), cells // 2
for i in range(cells):
    fault = victim = None
    if i == host_cell:
        fault = "host-kill"
    elif i == next_fault:
        fault, victim = rng.choice(["rank-kill", "rank-stop"]), rng.choice(list(s.members))
        next_fault = i + rng.randint(5, 12)
    if fault == "host-kill":  # between cells: the benchmark kills h2's agent and ranks
        say(kill_host=2)
        sys.stdin.readline()
    elif fault:
        pid = s.ready[victim]["pid"]
        sig = signal.SIGKILL if fault == "rank-kill" else signal.SIGSTOP
        threading.Timer(rng.uniform(0.02, 0.25), lambda: os.kill(pid, sig)).start()
    t0 = time.monotonic()
    try:
        r = s.run(CELL)
        failed, message = r.failed, r.message()
    except sessions.SessionError as e:
        failed, message = ["refused"], str(e)
    row = {"cell": i, "fault": fault, "victim": victim, "seconds": round(time.monotonic() - t0, 3),
           "failed": failed, "cause": message.splitlines()[0][:300] if message else None}
    if fault == "host-kill":
        lost = [m for m in s.members if s.ready.get(m, {}).get("host") == "h2"]
        row["named"] = bool(failed) and "lost with its host" in message
        try:
            s.run("1")
            row["refused_until_shrink"] = False
        except sessions.SessionError as e:
            row["refused_until_shrink"] = "shrink" in str(e)
        t1 = time.monotonic()
        s.shrink()
        row["shrink_s"] = round(time.monotonic() - t1, 2)
        for m in lost:
            counts.pop(m, None)
    elif failed:
        row["named"] = f"rank {victim}" in message and victim in r.failed
    if failed:  # what a user would look at: every rank's variables
        look = s.run(LOOK, want="gather")
        values = {m: look.value(m) for m in s.members} if not look.failed else {}
        back = [m for m in s.members if values.get(m, (0, 0, False))[2]]
        row["kept"] = all(values.get(m, (None,))[0] == m * 7 for m in s.members if m not in back)
        row["count_kept"] = all((values.get(m) or (0, -1))[1] >= counts[m] for m in s.members if m not in back)
        row["replaced"] = back
        for m in back:  # the user runs the setup cell again on the new rank
            s.run(SETUP + "sdp_replaced = False\n", ranks=[m])
            counts[m] = 0
        s.run("sdp_replaced = False\n")
    else:
        for m in counts:
            counts[m] += 1
    rows.append(row)
    say(cell=row)
final = s.run(LOOK, want="gather")
say(end={m: final.value(m) for m in s.members}, members=list(s.members), failed=final.failed, stopped=s.stop())
'''


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--cells", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results", "session_chaos.json"))
    args = p.parse_args()
    from sdp_jupyter.testing.cluster import Cluster
    from sdp_jupyter.testing.sshd import SSHHosts

    t_start = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="sdp-bench-session-chaos-"))
    cluster = Cluster(hosts=4).start()
    hosts = proc = None
    rows: list[dict] = []
    end: dict = {}
    left: dict = {}
    try:
        hosts = SSHHosts(cluster, root / "ssh")
        (root / "ssh").mkdir(mode=0o700)
        hosts.start()
        spec = {"target": "ssh", "ssh": {"hosts": "h1,h2", "config": str(hosts.config)},
                "jobs_dir": str(root / "jobs"), "seed": args.seed, "cells": args.cells}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        proc = cluster.popen(0, [sys.executable, "-c", DRIVER, json.dumps(spec)], env=env, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.jobs_dir = spec["jobs_dir"]
        print(f"ready: ranks {next_line(proc, 180)['ready']}", flush=True)
        while True:
            # blocking reads from here: the driver prints one line per cell, and a select() before each
            # readline() misses a line that arrived in the same read as the one before it
            text = proc.stdout.readline()
            if not text:
                raise RuntimeError(f"the driver ended early: {proc.stderr.read()[-3000:]}")
            if not text.startswith("{"):
                continue
            line = json.loads(text)
            if "kill_host" in line:
                signal_all(hosts.processes(2) + hosts.processes(2, "sdp_jupyter.launch.host.agent"), signal.SIGKILL)
                tell(proc, "done")
            elif "cell" in line:
                row = line["cell"]
                rows.append(row)
                if row["fault"] or row["failed"]:
                    print(f"cell {row['cell']:3d}: {row['fault'] or 'no fault'} (rank {row['victim']}): "
                          f"{'failed' if row['failed'] else 'succeeded'} in {row['seconds']:.2f} s; named "
                          f"{row.get('named')}; kept {row.get('kept')}; replaced {row.get('replaced')}; "
                          f"{(row.get('cause') or '')[:120]}", flush=True)
            elif "end" in line:
                end = line
                break
        proc.wait(timeout=60)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if hosts is not None:
            left = {f"h{k}": len(v) for k, v in hosts.wait_clean(30).items()}
            for pids in hosts.wait_clean(0).values():
                signal_all(pids, signal.SIGKILL)
            hosts.stop()
        cluster.close()
        shutil.rmtree(root, ignore_errors=True)
    total = time.monotonic() - t_start
    faults = [r for r in rows if r["fault"]]
    lost = [r for r in rows if r["failed"]]
    unexplained = [r for r in lost if not r.get("named")] + [r for r in rows if r["seconds"] > 120]
    spoiled = [r for r in lost if r.get("kept") is False or r.get("count_kept") is False]
    slow = [r["seconds"] for r in lost if r["fault"] in ("rank-kill", "rank-stop")]
    print(f"\n{'cells':>5} {'faults':>6} {'cells lost':>10} {'unexplained':>11} {'survivors lost state':>20}"
          f" {'failed cell s (median, max)':>28}")
    print(f"{len(rows):5d} {len(faults):6d} {len(lost):10d} {len(unexplained):11d} {len(spoiled):20d}"
          f" {statistics.median(slow) if slow else float('nan'):14.2f} {max(slow, default=float('nan')):13.2f}")
    for kind in ("rank-kill", "rank-stop", "host-kill"):
        mine = [r for r in faults if r["fault"] == kind]
        print(f"{kind:9} x{len(mine)}: cells failed {sum(bool(r['failed']) for r in mine)}, cause named "
              f"{sum(bool(r.get('named')) for r in mine)}" + (
                  f", refused until shrink {mine[0].get('refused_until_shrink')}, shrink {mine[0].get('shrink_s')} s"
                  if kind == "host-kill" and mine else ""))
    print(f"end: ranks {end.get('members')}, values {end.get('end')}, stopped {end.get('stopped')}; "
          f"left on the hosts: {left or 'nothing'}; {total:.0f} s")
    write_results(args.out, machine_info(), rows, seed=args.seed, cells=len(rows), faults=len(faults),
                  cells_lost=len(lost), unexplained=len(unexplained), survivors_lost_state=len(spoiled),
                  end=end, leftovers=left, total_s=round(total, 1))


if __name__ == "__main__":
    main()
