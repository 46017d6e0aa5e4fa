"""A chaos soak: one elastic job, faults of every kind at random moments for as long as you ask, on the
SSH test hosts, and at the end the weights of a run that never failed.

    sudo PYTHONPATH=. .venv/bin/python benchmarks/elastic_churn.py [--minutes 30] [--events N] [--seed 0]
        [--kinds rank-kill,rank-stop,host-kill,host-stop,cut,slow] [--heal] [--out results/elastic_churn.json]

It starts its own test hosts (sdp_jupyter.testing: Cluster(hosts=4), sshd on h1..h3, the "notebook" a
driver on h0; root needed) and one job, `--nodes 2:3 --max-restarts 10000`, one rank per node, that trains
until told to end (a checkpoint every step). Every 1-8 s (seeded) once the job trains on 3 nodes again, it
draws a host (h1, h2 or h3: node 0 included) and a fault (tests/helpers/chaos.py says what each does and
how the training is kept deterministic whatever the membership) and measures, per fault:

  detected    from the fault until the launcher found the node lost (a node's loss), or re-formed the job
              (a rank's death: the attempt fails, and the same hosts start again)
  back        until rank 0's log shows a step of a later attempt (or, for a cut the job rode out, 3
              steps past the healing in the same attempt)
  lost        steps trained again: the last step rank 0 had printed at the fault + 1 - the step resumed from
  3 again     until the job trains on all 3 hosts again

With --heal the job is `--nodes 3 --heal` instead, training through sdp_jupyter.heal.Healer: a rank's
death is healed in place (its peers go on, its replacement joins) and "detected" is the launcher's heal
record. A lost host fails such a job by design (healing and elastic membership are not combined), so only
rank-kill, rank-stop and slow are drawn. A fault the job does not recover from within --rejoin-wait seconds
ends the injections. Then the end file
is written and the job must succeed with the same weights on every rank, equal to those of the same number
of steps trained in one process without a fault, no step skipped, and no process left on any host.
Not a test: nothing is asserted (tests/launch/test_chaos.py runs a few minutes of it and asserts).
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
from _spawn import bench_parser, machine_info, write_results  # noqa: E402
from helpers.chaos import HEAL_KINDS, KINDS, Soak  # noqa: E402


def table(events: list[dict], job: dict, total: float) -> None:
    print(f"\n{'event':>5} {'kind':9} {'host':4} {'step':>6} {'detected s':>10} {'back s':>7} {'world':>5}"
          f" {'lost':>4} {'3 again s':>9}  note")
    for ev in events:
        note = ("rode it out" if ev.get("rode_out") else
                f"{ev.get('steps_per_s_slowed')} steps/s while slowed, {ev.get('steps_per_s_after')} after"
                if ev["kind"] == "slow" else "; ".join(str(x)[:50] for x in ev["lost"]))
        print(f"{ev['event']:5} {ev['kind']:9} {ev['host']:4} {str(ev['step_at_fault']):>6}"
              f" {str(ev.get('detected_s')):>10} {str(ev.get('back_s')):>7} {str(ev.get('world')):>5}"
              f" {str(ev.get('steps_lost')):>4} {str(ev.get('three_again_s')):>9}  {note}")
    print(f"\njob: {job.get('state')} after {job.get('job_s')} s, {job.get('steps')} steps, restarts "
          f"{job.get('restarts')}, {job.get('formations')} formations; same weights on every rank: "
          f"{job.get('same_weights')}; equal to the uninterrupted run's ({job.get('reference')}): "
          f"{job.get('equals_reference')}; no step skipped: {job.get('no_step_skipped')}; left on the hosts: "
          f"{job.get('leftovers') or 'nothing'}" + (f"; error: {job['error']}" if job.get("error") else ""))
    for kind in KINDS:
        mine = [e for e in events if e["kind"] == kind]
        if not mine:
            continue
        back = [e["back_s"] for e in mine if e.get("back_s") is not None]
        det = [e["detected_s"] for e in mine if e.get("detected_s") is not None]
        lost = [e["steps_lost"] for e in mine if e.get("steps_lost") is not None]
        print(f"{kind:9} x{len(mine):<3} recovered {sum(bool(e['recovered']) for e in mine)}"
              + (f", detected median {statistics.median(det):.1f} s" if det else "")
              + (f", back median {statistics.median(back):.1f} s (max {max(back):.1f})" if back else "")
              + (f", steps lost median {statistics.median(lost):g} (max {max(lost)})" if lost else ""))
    print(f"{len(events)} faults in {total:.0f} s")


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--minutes", type=float, default=30.0, help="how long faults are injected")
    p.add_argument("--events", type=int, default=None, help="stop after this many faults")
    p.add_argument("--kinds", default=None, help=f"default: {','.join(KINDS)} ({','.join(HEAL_KINDS)} with --heal)")
    p.add_argument("--heal", action="store_true", help="a --nodes 3 --heal job instead of an elastic one")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--rejoin-wait", type=float, default=120.0, help="seconds a fault may take to recover from")
    p.add_argument("--cut-seconds", type=float, default=10.0)
    p.add_argument("--slow-seconds", type=float, default=20.0)
    p.add_argument("--slow-share", type=float, default=0.1, help="the share of one CPU a slowed host keeps")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the job's folder (its logs) and say where")
    p.add_argument("--out", default=os.path.join(HERE, "results", "elastic_churn.json"))
    args = p.parse_args()
    args.kinds = args.kinds or ",".join(HEAL_KINDS if args.heal else KINDS)
    from sdp_jupyter.testing.cluster import Cluster
    from sdp_jupyter.testing.sshd import SSHHosts

    print(f"seed {args.seed}, {args.minutes:g} minutes, {'--heal' if args.heal else 'elastic --nodes 2:3'}, "
          f"faults: {args.kinds}", flush=True)
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="sdp-bench-soak-"))
    os.chmod(root, 0o755)  # the ranks (root on the test hosts too) read the end file's folder
    cluster = Cluster(hosts=4).start()
    hosts = soak = None
    try:
        hosts = SSHHosts(cluster, root / "ssh")
        (root / "ssh").mkdir(mode=0o700)
        hosts.start()
        soak = Soak(hosts, root, seed=args.seed, kinds=args.kinds.split(","), step_sleep=args.step_sleep,
                    rejoin_wait=args.rejoin_wait, cut_s=args.cut_seconds, slow_s=args.slow_seconds,
                    slow_share=args.slow_share, heal=args.heal, say=lambda s: print(s, flush=True))
        soak.run(args.minutes, args.events)
    finally:
        if soak is not None and hosts is not None:
            soak.job["leftovers"] = soak.leftovers()
        if hosts is not None:
            hosts.stop()
        cluster.close()
        if args.keep:
            print(f"kept: {root / 'jobs' / 'soak'}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = time.monotonic() - t0
    table(soak.events, soak.job, total)
    write_results(args.out, machine_info(), soak.events, seed=args.seed, minutes=args.minutes, kinds=args.kinds,
                  heal=args.heal,
                  step_sleep=args.step_sleep, total_s=round(total, 1), job=soak.job)


if __name__ == "__main__":
    main()
