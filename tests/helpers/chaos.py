"""A chaos soak: one elastic job (`--nodes 2:3`, one rank per node) on the SSH test hosts h1..h3 trains
until told to end while faults are injected at random (seeded) moments. Used by benchmarks/elastic_churn.py
(30 minutes) and tests/launch/test_chaos.py (a few minutes).

Training is deterministic by design, whatever the membership: each step's global batch (48 rows) comes
from a generator seeded with the step's number, cut into 6 micro-batches of 8; a rank of a world of W
computes the gradients of micro-batches rank*6/W .. (rank+1)*6/W - 1, one by one, turns each into
fixed point (int64, 2**-32 units) and sums them; one all_reduce(SUM) of int64 adds the ranks' sums.
Integer sums do not depend on their order, so the averaged gradient is the same bits on 1, 2 or 3
ranks, and a step redone after a re-formation computes what it computed the first time. The final
weights must then equal those of the same training run in one process, uninterrupted (`reference`).

Faults (one host h1..h3 drawn per event, node 0 included):

  rank-kill  SIGKILL the host's rank (its agent stays): a failed attempt, re-formed on the same hosts
  rank-stop  SIGSTOP the host's rank: its agent kills it after SDP_STOPPED_RANK_S (10 s), then as above
  host-kill  SIGKILL the host's agent and rank (sshd stays, so the host comes back at once)
  host-stop  SIGSTOP the same; SIGCONT once the job trains again without it
  cut        the host's link down for `cut_s` seconds, then up
  slow       the host held to `slow_share` of a CPU (a cgroup; a tenth) for `slow_s` seconds: not a failure
"""
from __future__ import annotations

import contextlib
import json
import random
import re
import signal
import time
from pathlib import Path

from helpers.monitor_jobs import wait_for
from helpers.remote_jobs import LAUNCH, drive, next_line
from sdp_jupyter.testing.cluster import signal_all

KINDS = ("rank-kill", "rank-stop", "host-kill", "host-stop", "cut", "slow")
HEAL_KINDS = ("rank-kill", "rank-stop", "slow")

# The step, shared by the job's script and the reference run (exec'd in both).
STEP_CODE = r'''
import torch
GLOBAL, PARTS, SCALE = 48, 6, 2.0 ** 32

def make_model():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 4))
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

def local_sum(model, step, rank, world):
    """This rank's micro-batches' gradients in fixed point, summed; and their summed loss."""
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(GLOBAL, 64, generator=g), torch.randn(GLOBAL, 4, generator=g)
    size, per = GLOBAL // PARTS, PARTS // world
    total, loss_sum = None, 0.0
    for part in range(rank * per, (rank + 1) * per):
        model.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[part * size:(part + 1) * size]), y[part * size:(part + 1) * size])
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        fixed = torch.round(flat.double() * SCALE).to(torch.int64)
        total = fixed if total is None else total + fixed
        loss_sum += loss.item()
    return total, loss_sum

def apply_sum(model, opt, total):
    flat, at = (total.double() / SCALE / PARTS).float(), 0
    for p in model.parameters():
        p.grad.copy_(flat[at:at + p.numel()].view_as(p)); at += p.numel()
    opt.step()

def digest(model):
    import hashlib
    return hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest()[:16]
'''

# Trains until $END_FILE exists, agreed by all ranks each step (a MAX all_reduce), so all stop together.
SCRIPT = r'''
import os, time, torch, torch.distributed as dist
from sdp_jupyter import checkpoint
torch.set_num_threads(1)  # one thread: the same bits on every host and in the reference
exec(os.environ["STEP_CODE"])
dist.init_process_group("smddp")
rank, world = dist.get_rank(), dist.get_world_size()
model, opt = make_model()
state = checkpoint.load()
start = 0
if state:
    model.load_state_dict(state["model"]); opt.load_state_dict(state["opt"]); start = state["step"] + 1
print(f"attempt {os.environ['SDP_RESTART']} world {world} from step {start}", flush=True)
step = start
while True:
    total, loss_sum = local_sum(model, step, rank, world)
    dist.all_reduce(total)
    apply_sum(model, opt, total)
    checkpoint.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()})
    print(f"step {step} loss {loss_sum:.4f}", flush=True)
    end = torch.tensor([float(os.path.exists(os.environ["END_FILE"]))])
    dist.all_reduce(end, op=dist.ReduceOp.MAX)
    if end.item():
        break
    step += 1
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.1")))
print(f"final rank {rank} step {step} weights {digest(model)}", flush=True)
'''

# The same training through the Healer (a --heal job): a dead rank's peers go on without it and take its
# replacement back; every rank prints its steps with the generation (membership) it trained them in.
HEAL_SCRIPT = r'''
import os, time, torch, torch.distributed as dist
from sdp_jupyter.heal import Healer
torch.set_num_threads(1)
exec(os.environ["STEP_CODE"])
model, opt = make_model()
healer = Healer(model, opt, wrap=lambda m: m)  # makes the process group (and makes it again at each change)
for step in healer.steps(10 ** 9):
    def train_step():
        total, loss_sum = local_sum(healer.model, step, dist.get_rank(), dist.get_world_size())
        dist.all_reduce(total)
        end = torch.tensor([float(os.path.exists(os.environ["END_FILE"]))])
        dist.all_reduce(end, op=dist.ReduceOp.MAX)  # every collective before the optimizer's step
        apply_sum(healer.model, opt, total)
        return loss_sum, end.item()
    loss_sum, end = healer.run(train_step)
    print(f"step {step} loss {loss_sum:.4f} generation {healer.generation} world {dist.get_world_size()}", flush=True)
    if end:
        break
    time.sleep(float(os.environ.get("STEP_SLEEP", "0.1")))
print(f"final rank {healer.rank} step {step} weights {digest(model)}", flush=True)
healer.close()
'''

DRIVER = LAUNCH + r'''
print(json.dumps({"dir": str(job.dir)}), flush=True)
job.wait()
print(json.dumps({"state": job.state, "error": job.error, "t": time.time(), "restarts": job.restarts,
                  "membership": job.status.get("membership", []), "heals": job.status.get("heals", [])}), flush=True)
'''

STEP = re.compile(r"^step (\d+) loss ")
HEAL_STEP = re.compile(r"^step (\d+) loss \S+ generation (\d+) world (\d+)$")
ATTEMPT = re.compile(r"^attempt (\d+) world (\d+) from step (\d+)")
FINAL = re.compile(r"^final rank (\d+) step (\d+) weights (\w+)$", re.M)


def reference(steps: int) -> str:
    """The weights' digest after `steps` steps in one process, uninterrupted."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        space: dict = {}
        exec(STEP_CODE, space)
        model, opt = space["make_model"]()
        for step in range(steps):
            total, _ = space["local_sum"](model, step, 0, 1)
            space["apply_sum"](model, opt, total)
        return space["digest"](model)
    finally:
        torch.set_num_threads(threads)


def read_log(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()
    except OSError:
        return []


def _progress(lines: list[str]) -> tuple[int, int, int | None, int | None]:
    """(the last attempt seen, its start step, its world, the last step printed in it or None)"""
    attempt, start, world, last = -1, 0, None, None
    for line in lines:
        if m := ATTEMPT.match(line):
            attempt, world, start, last = int(m[1]), int(m[2]), int(m[3]), None
        elif m := STEP.match(line):
            last = int(m[1])
    return attempt, start, world, last


def _heal_progress(logs: list[list[str]]) -> tuple[int, int, int | None, int | None]:
    """As _progress, for a --heal job over every rank's log: the newest generation any rank trained a step in."""
    seen: dict[int, list[tuple[int, int]]] = {}
    for lines in logs:
        for m in filter(None, map(HEAL_STEP.match, lines)):
            seen.setdefault(int(m[2]), []).append((int(m[1]), int(m[3])))
    if not seen:
        return -1, 0, None, None
    g = max(seen)
    return g, min(st for st, _ in seen[g]), seen[g][-1][1], max(st for st, _ in seen[g])


def _membership(job_dir: Path) -> list[dict]:
    try:
        return [e for e in json.loads((job_dir / "status.json").read_text()).get("membership", []) if "hosts" in e]
    except (OSError, ValueError):
        return []


def rank_pids(hosts, host: int) -> list[int]:
    """The rank processes on `host` (not the monitor's sampler, which runs the worker with --module)."""
    found = []
    for pid in hosts.processes(host):
        with contextlib.suppress(OSError):
            if b"--module" not in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                found.append(pid)
    return found


def _wait(pred, timeout: float):
    """`pred()`'s first true value within `timeout` seconds, else None."""
    try:
        return wait_for(pred, timeout)
    except AssertionError:
        return None


class Soak:
    """One soak on started SSH test hosts (sdp_jupyter.testing.sshd.SSHHosts on h1..h3 of a 4-host cluster)."""

    def __init__(self, hosts, root: Path, *, seed: int = 0, kinds=KINDS, step_sleep: float = 0.1,
                 rejoin_wait: float = 120.0, cut_s: float = 10.0, slow_s: float = 20.0, slow_share: float = 0.1,
                 cycle: bool = False,
                 heal: bool = False, say=print):
        self.hosts, self.cluster, self.root = hosts, hosts.cluster, Path(root)
        self.rng, self.kinds, self.say = random.Random(seed), list(kinds), say
        self.step_sleep, self.rejoin_wait, self.cut_s, self.slow_s = step_sleep, rejoin_wait, cut_s, slow_s
        self.slow_share = slow_share
        self.cycle = cycle  # the kinds in turn (each one met in a short run), else drawn at random
        # --nodes 3 --heal: a rank's death is healed in place; a lost host would fail the job (heal and elastic
        # are not combined), so only the rank's faults and a slow host are drawn
        self.heal = heal
        if heal and set(self.kinds) - set(HEAL_KINDS):
            raise ValueError(f"a --heal soak survives {', '.join(HEAL_KINDS)}, not {set(self.kinds) - set(HEAL_KINDS)}")
        self.events: list[dict] = []
        self.job: dict = {}
        self._undo: list = []  # what undoes the fault in progress (SIGCONT, a link up, a cgroup), run also on an error

    # ------------------------------------------------------------------ the run
    def run(self, minutes: float, max_events: int | None = None) -> dict:
        """Inject faults for `minutes` (or `max_events`), end the job, check it; the summary row."""
        end_file = self.root / "end"
        spec = {"target": "ssh", "ssh": {"hosts": self.hosts.hosts, "config": str(self.hosts.config)},
                "jobs_dir": str(self.root / "jobs"), "name": "soak", "procs_per_node": 1,
                **({"nodes": 3, "heal": True, "code": HEAL_SCRIPT} if self.heal else {"nodes": "2:3", "code": SCRIPT}),
                "max_restarts": 10000,
                "env": {"STEP_SLEEP": str(self.step_sleep), "END_FILE": str(end_file), "STEP_CODE": STEP_CODE}}
        t_launch = time.time()
        self.driver = d = drive(self.cluster, spec, driver=DRIVER)
        try:
            self.job_dir = Path(next_line(d, 120)["dir"])
            self.log = self.job_dir / "logs" / "rank-0.log"
            if not _wait(lambda: self._on_three(-1), 120):
                raise RuntimeError("the job never trained on 3 nodes")
            stop_at = time.monotonic() + minutes * 60
            while time.monotonic() < stop_at and (max_events is None or len(self.events) < max_events):
                time.sleep(self.rng.uniform(1.0, 8.0))
                ev = self.inject(len(self.events))
                self.events.append(ev)
                self.say(self.describe(ev))
                if not ev.get("recovered"):
                    self.say(f"event {ev['event']}: not recovered within {self.rejoin_wait:g} s: no more events")
                    break
            end_file.write_text("end")
            out = next_line(d, 240)
        finally:
            self.undo()
            if d.poll() is None:
                d.kill()
            d.wait()
        text = "\n".join(ln for lines in self._logs() for ln in lines)
        finals = {int(r): (int(s), w) for r, s, w in FINAL.findall(text)}
        steps = [int(m[1]) for m in map(STEP.match, text.splitlines()) if m]
        last = max(s for s, _ in finals.values()) if finals else None
        expected = reference(last + 1) if last is not None else None
        self.job = {"state": out["state"], "error": (out["error"] or "").splitlines()[0] if out["error"] else None,
                    "restarts": out["restarts"], "job_s": round(out["t"] - t_launch, 1), "steps": (last or 0) + 1,
                    "formations": len([f for f in out["membership"] if "hosts" in f]) + len(out.get("heals") or []),
                    "finals": {str(k): v for k, v in finals.items()}, "reference": expected,
                    "same_weights": len({w for _, w in finals.values()}) == 1 and len(finals) >= 2,
                    "equals_reference": bool(finals) and {w for _, w in finals.values()} == {expected},
                    "no_step_skipped": bool(steps) and set(range(max(steps) + 1)) <= set(steps)}
        return self.job

    def _logs(self) -> list[list[str]]:
        return [read_log(self.job_dir / "logs" / f"rank-{r}.log") for r in range(3)]

    def _progress(self) -> tuple[int, int, int | None, int | None]:
        """(the newest phase: an attempt, or a --heal job's generation; the step it began at; its world; the
        last step printed in it or None)"""
        return _heal_progress(self._logs()) if self.heal else _progress(read_log(self.log))

    def _changes(self) -> list[dict]:
        """The job's membership changes so far, each with when it was found (t_found) and made (t)."""
        if not self.heal:
            return [{**f, "t_found": min(f.get("lost_at", {}).values(), default=f["t"])} for f in _membership(self.job_dir)]
        try:
            heals = json.loads((self.job_dir / "status.json").read_text()).get("heals", [])
        except (OSError, ValueError):
            return []
        return [{**h, "t": h["at"], "t_found": h["at"], "hosts": h["members"], "lost": h.get("left")} for h in heals]

    def _changes_since(self, t: float) -> list[dict]:
        # by time, not by count: a --heal job's status lists its first generation only once a change came
        return [c for c in self._changes() if c["t"] >= t]

    def _on_three(self, after: int):
        """The job trains with 3 ranks in a phase after `after` (a step of it printed)."""
        phase, _, world, last = self._progress()
        return phase > after and last is not None and world == 3 and self.driver.poll() is None

    def _rode_out(self, phase: int, last: int | None):
        """"rode out" once phase `phase` printed 3 steps past `last`."""
        p, _, _, now = self._progress()
        return "rode out" if p == phase and now is not None and last is not None and now >= last + 3 else None

    # ------------------------------------------------------------------ one fault
    def inject(self, i: int) -> dict:
        host = self.rng.randint(1, 3)
        kind = self.kinds[i % len(self.kinds)] if self.cycle else self.rng.choice(self.kinds)
        attempt, _, _, fail_step = self._progress()
        ev = {"event": i, "host": f"h{host}", "kind": kind, "step_at_fault": fail_step}
        t_fail = time.time()

        def again():  # a later attempt (generation) trains
            a, start, world, last = self._progress()
            return (a, start, world) if a > attempt and last is not None else None

        if kind == "slow":
            from helpers.cgroup import cpu_limited

            ev["steps_per_s_before"] = self._rate(5.0)
            with cpu_limited(lambda: self.cluster.pids(host), self.slow_share):
                ev["steps_per_s_slowed"] = self._rate(self.slow_s)
            ev["steps_per_s_after"] = self._rate(5.0)
            got = None
        elif kind == "cut":
            self.cluster.cut(host)
            self._undo.append(lambda: self.cluster.heal(host))
            got = _wait(again, self.cut_s)
            time.sleep(max(0.0, t_fail + self.cut_s - time.time()))
            self.undo()
            at_heal = self._progress()
            # the job re-forms, or rides the cut out: the same attempt trains 3 steps past the healing
            got = got or _wait(lambda: again() or self._rode_out(attempt, at_heal[3]), self.rejoin_wait)
        else:
            pids = rank_pids(self.hosts, host)
            if kind.startswith("host"):
                pids += self.hosts.processes(host, "sdp_jupyter.launch.host.agent")
            signal_all(pids, signal.SIGKILL if kind.endswith("kill") else signal.SIGSTOP)
            ev["signalled"] = len(pids)
            if kind.endswith("stop"):
                self._undo.append(lambda: signal_all(pids, signal.SIGCONT))
            got = _wait(again, self.rejoin_wait)
            self.undo()  # a stopped process is continued once the job trains without it
        if got == "rode out":
            ev.update(back_s=round(time.time() - t_fail, 2), steps_lost=0, rode_out=True)
        elif got:
            forms = self._changes_since(t_fail)
            first = forms[0] if forms else {}
            ev.update(back_s=round(time.time() - t_fail, 2), resumed_from=got[1], world=got[2],
                      steps_lost=(fail_step + 1 - got[1]) if fail_step is not None else None,
                      reformed_s=round(first["t"] - t_fail, 2) if first else None,
                      detected_s=round(first["t_found"] - t_fail, 2) if first else None)
        full = _wait(lambda: self._on_three(-1 if got in (None, "rode out") else attempt), self.rejoin_wait)
        forms = self._changes_since(t_fail)
        ev["formations"] = [f["hosts"] for f in forms]
        ev["lost"] = [f["lost"] for f in forms if f.get("lost")]
        ev["three_again_s"] = round(time.time() - t_fail, 2) if full else None
        ev["recovered"] = bool(full) and (kind == "slow" or ev.get("back_s") is not None)
        return ev

    def _rate(self, seconds: float) -> float:
        first = self._progress()[3] or 0
        time.sleep(seconds)
        return round(((self._progress()[3] or 0) - first) / seconds, 2)

    def undo(self) -> None:
        while self._undo:
            with contextlib.suppress(Exception):
                self._undo.pop()()

    def leftovers(self, timeout: float = 30.0) -> dict:
        """Processes of the job still running on any host after `timeout` (killed, and counted)."""
        left = self.hosts.wait_clean(timeout)
        for pids in left.values():
            signal_all(pids, signal.SIGKILL)
        return {f"h{k}": len(v) for k, v in left.items()}

    @staticmethod
    def describe(ev: dict) -> str:
        if ev["kind"] == "slow":
            return (f"event {ev['event']}: slow {ev['host']}: {ev.get('steps_per_s_before')} steps/s before, "
                    f"{ev.get('steps_per_s_slowed')} while slowed, {ev.get('steps_per_s_after')} after; "
                    f"formations {ev['formations'] or 'none'}")
        return (f"event {ev['event']}: {ev['kind']} {ev['host']} at step {ev['step_at_fault']}: detected in "
                f"{ev.get('detected_s')} s, training again in {ev.get('back_s')} s (world {ev.get('world')}, "
                f"{ev.get('steps_lost')} steps lost), 3 nodes again in {ev.get('three_again_s')} s")
