"""Cold vs warm job time on SSH hosts: the same seeded 2-host training job, one after another from one
"notebook" process, as a user re-running a `%%sdp_train --target ssh` cell would.

    sudo PYTHONPATH=. python benchmarks/ssh_startup.py [--hosts 2] [--repeats 3] [--json out.json]

The hosts are real test hosts (sdp_jupyter.testing.cluster: network namespaces with their own
addresses) each running sshd (sdp_jupyter.testing.sshd); the driver runs on h0 and launches on h1..hN
with the SSH target. Each figure is the job's time from creation to its end (status.json `created` to
`ended`: agents started over ssh, ranks started, 6 training steps, result back). "cold": every rank a
fresh interpreter on its host. "warm": ranks forked from the kernel's pool on each host
(docs/warm.md, "On SSH hosts"); the first --warm job, which waits for the pools to import torch, is
printed apart ("warm, pool start"). Needs root and openssh-server. Not a test: nothing is asserted.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

DRIVER = r'''
import json, sys, sdp_jupyter
args, runs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for name, start in runs:
    job = sdp_jupyter.launch(**args, name=name, start=start)
    job.wait()
    st = job.status
    print(json.dumps({"name": name, "start": start, "state": job.state, "error": job.error,
                      "started": st.get("start"), "seconds": st["ended"] - st["created"]}), flush=True)
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hosts", type=int, default=2, help="SSH hosts of the job (1 to 3)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "ssh_startup.json"))
    a = ap.parse_args()
    sys.path.insert(0, REPO)
    from sdp_jupyter.testing.cluster import Cluster, available
    from sdp_jupyter.testing.sshd import SSHD, SSHHosts

    why = available() or (None if os.path.exists(SSHD) else f"{SSHD} is missing (apt-get install openssh-server)")
    if why:
        print(f"cannot make SSH test hosts here: {why}", file=sys.stderr)
        return 2
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers.remote_jobs import TRAIN  # the seeded job the SSH tests run

    runs = [[f"cold{i}", "cold"] for i in range(a.repeats)] + [["warm-first", "warm"]] \
        + [[f"warm{i}", "auto"] for i in range(a.repeats)]
    load = os.getloadavg()[0]
    with Cluster(hosts=4, rate=None) as c, tempfile.TemporaryDirectory() as root:
        os.chmod(root, 0o700)
        from pathlib import Path

        sshd = SSHHosts(c, Path(root))
        try:
            sshd.start()
            args = {"code": TRAIN, "target": "ssh", "jobs_dir": os.path.join(root, "jobs"),
                    "ssh": {"hosts": sshd.hosts[:a.hosts], "config": str(sshd.config)}}
            env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
            env.pop("SDP_WARM", None)
            p = c.run(0, [sys.executable, "-c", DRIVER, json.dumps(args), json.dumps(runs)], env=env,
                      check=False, timeout=900)
        finally:
            sshd.stop()
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    bad = [r for r in rows if r["state"] != "succeeded"]
    if p.returncode or bad or len(rows) != len(runs):
        print(f"the driver failed ({p.returncode}): {bad or p.stderr[-2000:]}", file=sys.stderr)
        return 1
    cold = [r["seconds"] for r in rows if r["start"] == "cold"]
    warm = [r["seconds"] for r in rows if r["start"] == "auto"]
    first = next(r["seconds"] for r in rows if r["start"] == "warm")
    print(f"machine: {os.cpu_count()} cpus, load {load:.2f}; {a.hosts} SSH test host(s) x 1 rank, 6 steps")
    print(f"{'start':<18} {'median s':>9} {'min s':>7} {'max s':>7}  runs")
    for label, xs in (("cold", cold), ("warm", warm)):
        print(f"{label:<18} {statistics.median(xs):>9.2f} {min(xs):>7.2f} {max(xs):>7.2f}  {len(xs)}")
    print(f"{'warm, pool start':<18} {first:>9.2f} {'':>7} {'':>7}  1 (the first --warm job waits for the pools)")
    print(f"warm vs cold: x{statistics.median(cold) / statistics.median(warm):.2f} faster (medians, same run)")
    not_warm = [r["name"] for r in rows if r["start"] != "cold" and r["started"] != "warm"]
    if not_warm:
        print(f"note: these jobs did not start warm: {', '.join(not_warm)}")
    out = {"hosts": a.hosts, "load": load, "cpus": os.cpu_count(), "runs": rows,
           "cold_median_s": statistics.median(cold), "warm_median_s": statistics.median(warm), "warm_first_s": first}
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
