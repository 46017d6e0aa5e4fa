"""One elastic job, many failures in a row: hosts that die, freeze or lose their link and come back,
again and again, at random moments, on the SSH test hosts.

    sudo PYTHONPATH=. .venv/bin/python benchmarks/elastic_churn.py [--events 6] [--seed 0]
                                                                   [--out results/elastic_churn.json]

It starts its own test hosts (sdp_jupyter.testing: Cluster(hosts=4), sshd on h1..h3, the "notebook" a
driver on h0; root needed) and one job, `--nodes 2:3`, one rank per node, that trains until told to end
(a checkpoint every step; each step also agrees on whether the end file exists, so every rank stops at
the same step). Then, --events times: once the job trains on 3 nodes, wait 0.5-3 s, draw a host (h1, h2
or h3: node 0 included) and a failure, and inject it:

  kill  SIGKILL the host's agent and every rank-side process (sshd stays: the host is usable at once)
  stop  SIGSTOP the same processes; SIGCONT once the job trains again without the host
  cut   take the host's link down; up again once the job trains again without it

and measure "to training again" (from the failure until rank 0's log shows a step of a later attempt)
and "to 3 nodes" (until the job trains again on all three hosts). An event whose job is not on 3 nodes
again within --rejoin-wait seconds ends the injections. Then the end file is written and the job must
succeed, with the same weights on every rank, no restart counted (membership changes are not failures)
and every step trained (the last step's number is the count of steps minus one, each attempt resumed
from the step after the last checkpoint). "redone" is the last step rank 0 had printed when the failure
was injected, plus 1, minus the step the next attempt started from (-1: one more step ended in between).
Not a test: nothing is asserted.
"""
from __future__ import annotations

import json
import os
import random
import re
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
from _spawn import bench_parser, machine_info, write_results  # noqa: E402
from elastic import ATTEMPT, DRIVER, STEP, _line, _progress, _read_log  # noqa: E402  (it puts tests/ on the path)
from helpers.monitor_jobs import wait_for  # noqa: E402
from helpers.remote_jobs import _STEP  # noqa: E402
from sdp_jupyter.testing.cluster import signal_all  # noqa: E402

# Trains until $END_FILE exists, agreed by all ranks each step (a MAX all_reduce), so all stop together.
SCRIPT = r'''
import hashlib, os, time, torch, torch.distributed as dist
from sdp_jupyter import checkpoint
dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
state = checkpoint.load()
start = 0
if state:
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"] + 1
print(f"attempt {os.environ['SDP_RESTART']} world {world} from step {start}", flush=True)
step = start
while True:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 4, generator=g)
STEP
    checkpoint.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()})
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    end = torch.tensor([float(os.path.exists(os.environ["END_FILE"]))])
    dist.all_reduce(end, op=dist.ReduceOp.MAX)
    if end.item():
        break
    step += 1
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.1")))
digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
print(f"final rank {rank} step {step} weights {digest}", flush=True)
'''.replace("STEP\n", _STEP)

FINAL = re.compile(r"^final rank (\d+) step (\d+) weights (\w+)$", re.M)


def _membership(job_dir: Path) -> list[dict]:
    try:
        return [e for e in json.loads((job_dir / "status.json").read_text()).get("membership", []) if "hosts" in e]
    except (OSError, ValueError):
        return []


def _host_procs(hosts, host: int) -> list[int]:
    return hosts.processes(host) + hosts.processes(host, "sdp_jupyter.launch.host.agent")


def _wait(pred, timeout: float):
    """`pred()`'s first true value within `timeout` seconds, else None."""
    try:
        return wait_for(pred, timeout)
    except AssertionError:
        return None


def main() -> None:
    p = bench_parser(__doc__)
    p.add_argument("--events", type=int, default=6)
    p.add_argument("--kinds", default="kill,stop,cut")
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--rejoin-wait", type=float, default=120.0,
                   help="seconds an event may take until the job trains on 3 nodes again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the job's folder (its logs) and say where")
    p.add_argument("--out", default=os.path.join(HERE, "results", "elastic_churn.json"))
    args = p.parse_args()
    from sdp_jupyter.testing.cluster import Cluster
    from sdp_jupyter.testing.sshd import SSHHosts

    rng = random.Random(args.seed)
    kinds = args.kinds.split(",")
    t0 = time.monotonic()
    root = Path(tempfile.mkdtemp(prefix="sdp-bench-churn-"))
    os.chmod(root, 0o755)  # the ranks (root on the test hosts too) read the end file's folder
    end_file = root / "end"
    cluster = Cluster(hosts=4).start()
    hosts = d = None
    events: list[dict] = []
    row: dict = {}
    restore = None  # what undoes the failure in progress (SIGCONT, heal), run also on an exception
    try:
        hosts = SSHHosts(cluster, root / "ssh")
        (root / "ssh").mkdir(mode=0o700)
        hosts.start()
        spec = {"target": "ssh", "ssh": {"hosts": hosts.hosts, "config": str(hosts.config)},
                "jobs_dir": str(root / "jobs"), "name": "churn", "procs_per_node": 1, "nodes": "2:3",
                "env": {"STEP_SLEEP": str(args.step_sleep), "END_FILE": str(end_file)}, "code": SCRIPT}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
        t_launch = time.time()
        d = cluster.popen(0, [sys.executable, "-c", DRIVER, json.dumps(spec)], env=env, text=True,
                          stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        first = _line(d, 120)
        if not first or "dir" not in first:
            raise RuntimeError(f"the driver did not start the job: {d.stderr.read()[-2000:] if d.poll() is not None else ''}")
        job_dir = Path(first["dir"])
        log = job_dir / "logs" / "rank-0.log"

        def on_three(after: int = -1) -> bool:
            """The job trains on 3 nodes in an attempt after `after` (rank 0 printed a step of it)."""
            lines = _read_log(log)
            attempt, _, _, stepped = _progress(lines)
            worlds = [int(m[2]) for m in map(ATTEMPT.match, lines) if m]
            return attempt > after and stepped and worlds[-1:] == [3] and d.poll() is None

        if not _wait(on_three, 120):
            raise RuntimeError("the job never trained on 3 nodes")
        for i in range(args.events):
            time.sleep(rng.uniform(0.5, 3.0))
            host, kind = rng.randint(1, 3), rng.choice(kinds)
            fail_attempt, _, fail_step, _ = _progress(_read_log(log))
            formations_before = len(_membership(job_dir))
            ev = {"event": i, "host": f"h{host}", "kind": kind, "last_step_at_failure": fail_step}
            t_fail = time.time()
            if kind == "cut":
                cluster.cut(host)
                restore = lambda h=host: cluster.heal(h)  # noqa: E731
            else:
                pids = _host_procs(hosts, host)
                signal_all(pids, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
                ev["signalled"] = len(pids)
                if kind == "stop":
                    restore = lambda pids=pids: signal_all(pids, signal.SIGCONT)  # noqa: E731

            def again():
                attempt, start, _, stepped = _progress(_read_log(log))
                return (attempt, start) if attempt > fail_attempt and stepped else None

            got = _wait(again, args.rejoin_wait)
            if got:
                ev.update(back_s=round(time.time() - t_fail, 2), resumed_from=got[1],
                          redone=(fail_step + 1 - got[1]) if fail_step is not None else None,
                          world=len(_membership(job_dir)[-1]["hosts"]) if _membership(job_dir) else None)
            if restore is not None:
                restore()
                restore = None
                ev["restored_s"] = round(time.time() - t_fail, 2)
            full = _wait(lambda: on_three(fail_attempt), args.rejoin_wait)
            forms = _membership(job_dir)
            ev["formations"] = [f["hosts"] for f in forms[formations_before:]]
            ev["lost"] = [f.get("lost") for f in forms[formations_before:] if f.get("lost")]
            if full:
                ev["three_again_s"] = round(time.time() - t_fail, 2)
            events.append(ev)
            print(f"event {i}: {kind} h{host} at step {fail_step}: training again in {ev.get('back_s')} s "
                  f"(world {ev.get('world')}, {ev.get('redone')} redone), 3 nodes again in {ev.get('three_again_s')} s; "
                  f"formations {ev['formations']}", flush=True)
            if not full:
                print(f"event {i}: the job is not on 3 nodes again within {args.rejoin_wait:g} s: no more events",
                      flush=True)
                break
        end_file.write_text("end")
        out = _line(d, 240)
        if out is None:
            raise RuntimeError(f"the driver said nothing at the end: {d.stderr.read()[-2000:] if d.poll() is not None else ''}")
        text = "\n".join(ln for r in range(3) for ln in _read_log(job_dir / "logs" / f"rank-{r}.log"))
        finals = {int(r): (int(s), w) for r, s, w in FINAL.findall(text)}
        steps = [int(m[1]) for m in map(STEP.match, _read_log(log)) if m]
        row = {"state": out["state"], "error": (out["error"] or "").splitlines()[0] if out["error"] else None,
               "restarts": out["restarts"], "job_s": round(out["t"] - t_launch, 2),
               "formations": [f.get("hosts") for f in out["membership"] if "hosts" in f],
               "finals": {str(k): v for k, v in finals.items()},
               "same_weights": len({w for _, w in finals.values()}) == 1 and len(finals) >= 2,
               # every step number from 0 to the last appears in rank 0's log (no step skipped)
               "no_step_skipped": bool(steps) and set(range(max(steps) + 1)) <= set(steps)}
    finally:
        if restore is not None:
            restore()
        if d is not None and d.poll() is None:
            d.kill()
        if d is not None:
            d.wait()
        if hosts is not None:
            left = hosts.wait_clean(30)
            row["leftovers"] = {str(k): len(v) for k, v in left.items()}
            for pids in left.values():
                signal_all(pids, signal.SIGKILL)
            hosts.stop()
        cluster.close()
        if args.keep:
            print(f"kept: {root / 'jobs' / 'churn'}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    total = time.monotonic() - t0
    print(f"\n{'event':>5} {'kind':5} {'host':4} {'step':>5} {'training again s':>17} {'world':>5} {'redone':>6}"
          f" {'3 nodes again s':>16}  lost")
    for ev in events:
        print(f"{ev['event']:5} {ev['kind']:5} {ev['host']:4} {str(ev['last_step_at_failure']):>5}"
              f" {str(ev.get('back_s')):>17} {str(ev.get('world')):>5} {str(ev.get('redone')):>6}"
              f" {str(ev.get('three_again_s')):>16}  {'; '.join(str(x)[:60] for x in ev['lost'])}")
    back = [e["back_s"] for e in events if e.get("back_s") is not None]
    full = [e["three_again_s"] for e in events if e.get("three_again_s") is not None]
    print(f"job: {row.get('state')} after {row.get('job_s')} s, restarts {row.get('restarts')}, "
          f"{len(row.get('formations') or [])} formations, same weights on every rank: {row.get('same_weights')}, "
          f"no step skipped: {row.get('no_step_skipped')}, leftovers: {row.get('leftovers') or 'none'}"
          + (f"; error: {row['error']}" if row.get("error") else ""))
    if back:
        print(f"to training again: median {statistics.median(back):.2f} s, max {max(back):.2f} s"
              + (f"; to 3 nodes again: median {statistics.median(full):.2f} s, max {max(full):.2f} s" if full else ""))
    print(f"{len(events)} events in {total:.0f} s")
    write_results(args.out, machine_info(), events, seed=args.seed, kinds=kinds, step_sleep=args.step_sleep,
                  total_s=round(total, 1), job=row)


if __name__ == "__main__":
    main()
