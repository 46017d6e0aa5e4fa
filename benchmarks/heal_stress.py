"""Many rounds of a rank SIGKILLed or SIGSTOPped at a random moment of a 4-rank DDP job: healing in
place (--heal) against a checkpoint restart (--max-restarts), the same failure for both, in one run.

    PYTHONPATH=. python benchmarks/heal_stress.py [--rounds 10] [--steps 150] [--seed 0] [--second 0.5]
                                                 [--target ssh] [--out results/heal_stress.json]

Each round draws a rank (rank 0 included), a signal (SIGKILL, or SIGSTOP: the launcher kills a rank
stopped for SDP_STOPPED_RANK_S, 2 s here), a step and a delay of 0-30 ms into it, and sends the
signal from outside the job to whichever process is that rank then. With --second P, a round has a
second death with probability P: another rank SIGKILLed 0-1 s after the first signal, while the
others notice the first, form their group or redo the step. benchmarks/heal.py's script
runs, its ranks writing their pids and steps. A round is "ok" when the job succeeds and every rank
ends with the same weights; "failed" when the job fails (its error is kept); "hang" when it has not
ended after --deadline seconds (then it is stopped). "lost" is a job's wall time minus the clean
run's. With --target ssh (root needed) the same rounds run on SSH test hosts (sdp_jupyter.testing: Cluster,
sshd on h1..h3), two hosts of two ranks each, the job started by a driver on h0 as a notebook there
would: a dead rank is started again by its host's agent, and the records and the ranks' answers travel
through the agents' links. Results go to results/heal_stress_ssh.json unless --out says otherwise.
Not a test: nothing is asserted.
"""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _spawn import bench_parser, machine_info, read_text as _read, write_results  # noqa: E402
from heal import SCRIPT  # noqa: E402

REPO = os.path.dirname(HERE)
DRIVER = "import json, sys, sdp_jupyter; sdp_jupyter.launch(**json.loads(sys.argv[1])).wait()"


class _DriverJob:
    """What _round reads of a Job, for one a driver on the test host h0 runs on the SSH test hosts (the
    job directory is on the shared disk: its status.json, logs and result are read here)."""

    def __init__(self, proc: subprocess.Popen, job_dir: str):
        self.proc, self.dir = proc, job_dir

    @property
    def done(self) -> bool:
        return self.proc.poll() is not None

    @property
    def status(self) -> dict:
        from sdp_jupyter import jobdir

        return jobdir.read_json(os.path.join(self.dir, jobdir.STATUS), {})

    def wait(self, timeout: float) -> str:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return "running"
        return self.status.get("state", "failed")

    def stop(self) -> None:
        self.proc.terminate()  # the driver's exit hook stops the job on every host

    def result(self):
        from sdp_jupyter import jobdir

        return jobdir.load_pickle(os.path.join(self.dir, jobdir.RESULT))


def _launch(script: str, work: str, name: str, env: dict, extra: dict, ssh):
    """The round's job: 4 local ranks, or (`ssh`: the test hosts) two SSH hosts of two ranks each."""
    from sdp_jupyter.launch import launch

    jobs = os.path.join(work, "jobs")
    if ssh is None:
        return launch(script, nodes=4, backend="smddp", env=env, jobs_dir=jobs, name=name, ranks_output="all",
                      **extra)
    cluster, hosts = ssh
    spec = {"code": open(script).read(), "target": "ssh", "ssh": {"hosts": hosts.hosts[:2], "config": str(hosts.config)},
            "nodes": 2, "procs_per_node": 2, "backend": "smddp", "env": env, "jobs_dir": jobs, "name": name,
            "ranks_output": "all", **extra}
    full = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    proc = cluster.popen(0, [sys.executable, "-c", DRIVER, json.dumps(spec)], env=full, stdin=subprocess.DEVNULL,
                         stdout=subprocess.DEVNULL, stderr=open(os.path.join(work, name + ".driver.log"), "w"))
    job = _DriverJob(proc, os.path.join(jobs, name))
    deadline = time.monotonic() + 120  # the job's folder appears once every host answered
    while not os.path.exists(os.path.join(job.dir, "status.json")) and not job.done and time.monotonic() < deadline:
        time.sleep(0.05)
    return job


FINAL = re.compile(r"^final (\d+) (\S+)$", re.M)


def _strike(pids: str, rank: int, sig: signal.Signals, at_step: int, delay: float, job, deadline: float) -> dict:
    """Wait until the job's ranks pass `at_step`, then `delay` more, and signal `rank`'s process."""
    while time.monotonic() < deadline and not job.done:
        steps = [int(s) for s in (_read(os.path.join(pids, f"step-{r}")) for r in range(4)) if s]
        if steps and max(steps) >= at_step:
            time.sleep(delay)
            pid = _read(os.path.join(pids, f"rank-{rank}"))
            try:
                os.kill(int(pid), sig)
                return {"pid": int(pid), "at": time.time()}
            except (TypeError, ValueError, ProcessLookupError):
                return {"pid": None}
        time.sleep(0.005)  # fine enough for a 30 ms step; a tighter poll takes CPU from the measured job
    return {"pid": None}


def _round(script: str, work: str, name: str, mode: str, strike: dict | None, a, ssh=None) -> dict:
    pids = os.path.join(work, name + "-pids")
    os.makedirs(pids)
    extra = {"heal": True, "max_restarts": 3} if mode in ("heal", "clean") else {"max_restarts": 3}
    env = {"MODE": "heal" if mode == "clean" else mode, "STEPS": str(a.steps), "KILL_AT": "-1", "PIDS": pids,
           "SDP_STOPPED_RANK_S": "2"}
    job = _launch(script, work, name, env, extra, ssh)
    deadline = time.monotonic() + a.deadline
    sent = _strike(pids, strike["rank"], getattr(signal, strike["signal"]), strike["step"], strike["delay"], job,
                   deadline) if strike else {}
    if sent.get("pid") is not None and strike.get("second_rank") is not None:
        time.sleep(strike["second_delay"])
        second = _read(os.path.join(pids, f"rank-{strike['second_rank']}"))
        try:
            os.kill(int(second), signal.SIGKILL)
        except (TypeError, ValueError, ProcessLookupError):
            pass
    state = job.wait(max(1.0, deadline - time.monotonic()))
    if state not in ("succeeded", "failed", "stopped"):
        job.stop()
        job.wait(60)
        state = "hang"
    finals: dict[str, str] = {}
    for r in range(4):
        log = _read(os.path.join(job.dir, "logs", f"rank-{r}.log")) or ""
        for rank, value in FINAL.findall(log):
            finals[rank] = value  # a rank's last line wins (a restarted rank prints again)
    st = job.status
    # every member at the end printed the same weights (a replacement that came after training ended
    # leaves without printing; a restarted job ends with all 4)
    members = {str(r) for r in (st.get("heals") or [{"members": range(4)}])[-1]["members"]}
    same = set(finals) == members and len(set(finals.values())) == 1
    outcome = "ok" if state == "succeeded" and same else ("wrong" if state == "succeeded" else state)
    wall = (st.get("ended") or time.time()) - st["started"]
    return {"mode": mode, **(strike or {}), "sent": sent.get("pid") is not None, "outcome": outcome,
            "wall_s": round(wall, 2), "members_at_end": len(members), "heals": len(st.get("heals", [])), "restarts": st.get("restarts", 0),
            "loss": job.result() if state == "succeeded" else None,
            "error": (st.get("error") or "").partition("\n")[0][:200] if outcome != "ok" else "",
            "finals": finals}


def _ssh_hosts(work: str):
    """Four test hosts (h0 runs the drivers) with sshd on h1..h3; (cluster, SSHHosts)."""
    from sdp_jupyter.testing.cluster import Cluster
    from sdp_jupyter.testing.sshd import SSHHosts

    os.chmod(work, 0o755)  # the ranks on the test hosts (root there too) write their pids and steps here
    cluster = Cluster(hosts=4).start()
    try:
        os.mkdir(os.path.join(work, "ssh"), 0o700)
        hosts = SSHHosts(cluster, Path(work) / "ssh")
        hosts.start()
    except BaseException:
        cluster.close()
        raise
    return cluster, hosts


def _rounds(script: str, work: str, a, rng: random.Random, ssh) -> list[dict]:
    """The clean run, then each round's failure, healed and restarted."""
    rows = [_round(script, work, "clean-0", "clean", None, a, ssh)]
    print(f"... clean: {rows[0]['outcome']} in {rows[0]['wall_s']} s", flush=True)
    for i in range(a.rounds):
        strike = {"round": i, "rank": rng.randrange(4), "signal": rng.choice(["SIGKILL", "SIGSTOP"]),
                  "step": rng.randrange(5, a.steps - 10), "delay": round(rng.uniform(0, 0.03), 4)}
        if rng.random() < a.second:
            strike.update(second_rank=rng.choice([r for r in range(4) if r != strike["rank"]]),
                          second_delay=round(rng.uniform(0, 1.0), 3))
        for mode in ("heal", "restart"):
            row = _round(script, work, f"{mode}-{i}", mode, strike, a, ssh)
            rows.append(row)
            then = (f", rank {strike['second_rank']} SIGKILL {strike['second_delay'] * 1000:.0f} ms later"
                    if "second_rank" in strike else "")
            print(f"... round {i} {mode}: rank {strike['rank']} {strike['signal']} at step {strike['step']}"
                  f"+{strike['delay'] * 1000:.0f} ms{then}: {row['outcome']} in {row['wall_s']} s {row['error']}", flush=True)
    return rows


def main() -> None:
    ap = bench_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--second", type=float, default=0.0,
                    help="the chance that a round SIGKILLs another rank 0-1 s after the first signal")
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds before a round counts as a hang")
    ap.add_argument("--target", choices=("local", "ssh"), default="local")
    ap.add_argument("--out", default=None, help="default: results/heal_stress.json (heal_stress_ssh.json)")
    a = ap.parse_args()
    a.out = a.out or os.path.join(HERE, "results", "heal_stress.json" if a.target == "local" else "heal_stress_ssh.json")
    rng = random.Random(a.seed)
    work = tempfile.mkdtemp(prefix="sdp-heal-stress-")
    script = os.path.join(work, "train.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    ssh = _ssh_hosts(work) if a.target == "ssh" else None
    try:
        rows = _rounds(script, work, a, rng, ssh)
    finally:
        if ssh is not None:
            from sdp_jupyter.testing.cluster import signal_all

            cluster, hosts = ssh
            for pids in hosts.wait_clean(30).values():  # a round's leftovers would be a bug: said, then killed
                print(f"left on a test host: {pids}", flush=True)
                signal_all(pids, signal.SIGKILL)
            hosts.stop()
            cluster.close()
    clean = rows[0]["wall_s"]
    print(f"\n{'round':>5} {'rank':>4} {'signal':8} {'step':>4} {'then':>4} {'heal':>9} {'ranks':>5} {'lost s':>7} {'restart':>9}"
          f" {'lost s':>7}")
    pairs = [(h, r) for h, r in zip(rows[1::2], rows[2::2])]
    for h, r in pairs:
        for x in (h, r):
            x["lost_s"] = round(x["wall_s"] - clean, 2)
        print(f"{h['round']:5} {h['rank']:4} {h['signal']:8} {h['step']:4} {str(h.get('second_rank', '-')):>4} {h['outcome']:>9} {h['members_at_end']:5}"
              f" {h['lost_s']:7.2f}"
              f" {r['outcome']:>9} {r['lost_s']:7.2f}")
    for mode in ("heal", "restart"):
        got = [x for x in rows if x["mode"] == mode]
        counts = {o: sum(x["outcome"] == o for x in got) for o in ("ok", "failed", "hang", "wrong")}
        print(f"{mode}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    ok = [(h["lost_s"], r["lost_s"]) for h, r in pairs if h["outcome"] == r["outcome"] == "ok"]
    if ok:
        heal_lost = sorted(h for h, _ in ok)[len(ok) // 2]
        restart_lost = sorted(r for _, r in ok)[len(ok) // 2]
        print(f"median time lost: heal {heal_lost:.2f} s, restart {restart_lost:.2f} s"
              + (f" (restart / heal = {restart_lost / heal_lost:.1f}x)" if heal_lost > 0 else ""))
    write_results(a.out, machine_info(), rows, target=a.target, steps=a.steps, seed=a.seed, second=a.second,
                  clean_s=clean)


if __name__ == "__main__":
    main()
