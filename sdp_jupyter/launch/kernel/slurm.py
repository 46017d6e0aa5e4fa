"""The Slurm target: `%%sdp_train --target slurm --nodes 4` runs the cell in a Slurm allocation.

`sbatch` asks for the allocation (one task per node) with a holder script that keeps it while the
notebook uses it; once Slurm runs it, `srun --overlap` starts the per-host agent (launch/host/agent.py)
on each allocated node, reached over srun's stdin/stdout exactly as the SSH target reaches it over
ssh's, so output, metrics, the result, Stop and "no orphans" are the remote targets' (remote.py).
Inside an allocation already (a notebook in `salloc`, or on a compute node: $SLURM_JOB_ID set) the
agents run in that allocation and nothing is submitted.

Before anything is queued: `sbatch` on the PATH, and the request checked by `sbatch --test-only`
(partition, node count, time limit, account, QOS), its answer turned into the option to fix. While
the job waits in the queue the job view says so with Slurm's reason (Resources, Priority, ...).
Stop cancels the allocation (`scancel`); the holder also ends it when no agent has run in it for
HOLD_IDLE seconds, so a notebook killed outright leaves no allocation behind. A job Slurm ended
(time limit, preemption, node failure) fails with that reason; --max-restarts submits again.
See docs/slurm.md.
"""
from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import subprocess
import sys
import time

from sdp_jupyter.launch import target_options
from sdp_jupyter.launch.kernel import remote
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.launcher import create_job, prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.kernel.ssh import CONNECTED, SSHLink
from sdp_jupyter.launch.spec import JobSpec, SpecError

KEYS = target_options.SLURM_KEYS
POLL = 1.0        # seconds between looks at the queue while the job waits
HOLD_IDLE = 20    # the holder ends the allocation after this many seconds without an agent in it
HOLD_FIRST = 120  # ... or when no agent came this long after it started (the notebook went away)
COMMAND_TIMEOUT = 30

# The allocation's batch script: hold the nodes while the notebook's agents (srun steps) run in it.
HOLDER = f"""#!/bin/sh
# sdp_jupyter --target slurm: holds this allocation while the notebook's agents run in it
seen=0; idle=0
while :; do
  sleep 2
  if squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | grep -q -v -e '\\.batch$' -e '\\.extern$'; then
    seen=1; idle=0
  else
    idle=$((idle + 2))
  fi
  if [ $seen = 1 ] && [ $idle -ge {HOLD_IDLE} ]; then exit 0; fi
  if [ $seen = 0 ] && [ $idle -ge {HOLD_FIRST} ]; then exit 0; fi
done
"""

_GPUS_RE = re.compile(r"--(?:gpus-per-node|gres)[= ](?:gpu:)?(?:[A-Za-z0-9_]+:)?(\d+)")


def slurm_options(spec: JobSpec) -> dict:
    options = dict(spec.slurm or {})
    unknown = sorted(set(options) - KEYS)
    if unknown:
        raise SpecError("slurm", f"unknown Slurm option(s) {', '.join(unknown)}; known: {', '.join(sorted(KEYS))}")
    return options


def extra_args(options: dict) -> list[str]:
    try:
        return shlex.split(options.get("args") or "")
    except ValueError as e:
        raise SpecError("--slurm-args", f"cannot parse {options.get('args')!r} ({e}): check the quotes") from None


def gpus_asked(args: list[str]) -> int:
    """GPUs per node the sbatch options ask for (--gpus-per-node=N, --gres=gpu[:type]:N), else 0."""
    found = _GPUS_RE.search(" ".join(args))
    return int(found.group(1)) if found else 0


def run(argv: list[str], timeout: float = COMMAND_TIMEOUT, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A Slurm command; SpecError naming the fix when Slurm's commands are not here."""
    if shutil.which(argv[0]) is None:
        raise SpecError("--target", f"`{argv[0]}` is not on the PATH: this machine is not a Slurm login or "
                                    "compute node. Fix: run the notebook on a machine where `sbatch` works "
                                    "(docs/slurm.md)")
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin)
    except subprocess.TimeoutExpired:
        raise SpecError("--target", f"`{' '.join(argv[:2])}` did not answer within {timeout:g} s: is slurmctld "
                                    "reachable? (`sinfo` should answer)") from None


def sbatch_argv(spec: JobSpec, name: str, test_only: bool = False) -> list[str]:
    options = slurm_options(spec)
    argv = ["sbatch", "--parsable", f"--job-name=sdp-{name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1",
            "--output=/dev/null", "--open-mode=append"]
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("time", "--time")):
        if options.get(key):
            argv.append(f"{flag}={options[key]}")
    if test_only:
        argv.append("--test-only")
    return argv + extra_args(options)


def explain_refusal(spec: JobSpec, said: str) -> SpecError:
    """sbatch's refusal as the option to fix."""
    options = slurm_options(spec)
    text = said.strip().replace("sbatch: error: ", "")
    low = text.lower()
    if "invalid partition" in low:
        return SpecError("--partition", f"Slurm has no partition {options.get('partition')!r} ({text}). "
                                        f"Fix: --partition <one of {', '.join(partitions()) or 'sinfo -s'}>")
    if "node count" in low or "node configuration" in low or "nodes" in low and "exceed" in low:
        return SpecError("--nodes", f"{spec.nodes} nodes cannot be allocated there ({text}). "
                                    "Fix: fewer --nodes, or another --partition (`sinfo -s` lists them)")
    if "time limit" in low:  # where the cluster enforces partition limits (EnforcePartLimits)
        return SpecError("--time", f"{options.get('time')!r} is over the partition's limit ({text}). "
                                   "Fix: a shorter --time (`sinfo -o '%P %l'` shows each partition's limit)")
    if "account" in low:
        return SpecError("--account", f"Slurm refuses account {options.get('account')!r} ({text}). "
                                      "Fix: --account <one of yours> (`sacctmgr show assoc user=$USER`)")
    return SpecError("--slurm-args", f"sbatch refuses the request: {text}")


def minutes(limit: str) -> float | None:
    """A Slurm time ("30", "30:00", "1:30:00", "2-0", "2-12:00") in minutes; None for UNLIMITED / INFINITE."""
    text = str(limit).strip()
    if text.upper() in ("UNLIMITED", "INFINITE", ""):
        return None
    days, _, rest = text.rpartition("-") if "-" in text else ("0", "", text)
    try:
        parts = [float(x) for x in rest.split(":")]
        if "-" in text:  # days-hours[:minutes[:seconds]]
            h, m, sec = (parts + [0, 0])[:3]
        elif len(parts) == 3:
            h, m, sec = parts
        elif len(parts) == 2:  # minutes:seconds
            h, m, sec = 0, parts[0], parts[1]
        else:
            h, m, sec = 0, parts[0], 0
        return float(days or 0) * 1440 + h * 60 + m + sec / 60
    except ValueError:
        raise SpecError("--time", f"{limit!r} is not a Slurm time. Fix: --time 30 (minutes), 1:30:00 or 2-0") from None


def partition_limit(name: str | None) -> tuple[str, float | None] | None:
    """(partition, its MaxTime in minutes) for `name`, or the default partition; None when Slurm does not say."""
    p = subprocess.run(["scontrol", "-o", "show", "partition"] + ([name] if name else []), capture_output=True,
                       text=True, timeout=COMMAND_TIMEOUT)
    for line in p.stdout.splitlines():
        fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
        if name or fields.get("Default") == "YES":
            return fields.get("PartitionName", name or "?"), minutes(fields.get("MaxTime", "UNLIMITED"))
    return None


def partitions() -> list[str]:
    p = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT)
    return [x.strip().rstrip("*") for x in p.stdout.split() if x.strip()]


def job_state(job_id: str) -> dict:
    """Slurm's record of a job: JobState, Reason, NodeList, ... ({} once Slurm has forgotten it)."""
    p = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                       timeout=COMMAND_TIMEOUT)
    if p.returncode != 0:
        return {}
    fields = {}
    for word in p.stdout.split():
        key, sep, value = word.partition("=")
        if sep:
            fields[key] = value
    return fields


def hostnames(nodelist: str) -> list[str]:
    p = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                       timeout=COMMAND_TIMEOUT)
    return [h for h in p.stdout.split() if h]


class SlurmLink(SSHLink):
    """One allocated node's agent, started by `srun` in the allocation (its stdin/stdout are the channel)."""

    kind = "srun"
    connect_timeout = 30  # srun waits for slurmd to start the step

    def __init__(self, node: int, host: str, run: "SlurmRun", inbox: queue.Queue):
        self.command = ["srun", f"--jobid={run.slurm_id}", "--overlap", "--nodes=1", "--ntasks=1",
                        f"--nodelist={host}", "--unbuffered", "--kill-on-bad-exit=0", "--quiet",
                        f"--job-name=sdp-agent-{node}", "sh", "-c",
                        f"echo {CONNECTED} >&2; exec {shlex.quote(sys.executable)} -m sdp_jupyter.launch.host.agent"]
        super().__init__(node, host, run.spec, inbox)

    def command_line(self, host: str, spec: JobSpec) -> list[str]:
        return self.command

    def unreachable(self) -> str:
        return (f"srun did not start the agent there within {self.connect_timeout} s (`srun --jobid ... hostname` "
                "should work from this machine)")

    def diagnose(self, code, python: str) -> str:
        said = remote.Link.diagnose(self, code, python)
        if said.startswith("sdp_jupyter is not installed"):
            return said + " (an environment the compute nodes share; docs/slurm.md)"
        return said.replace("the agent did not start", "srun could not run the agent")


class SlurmRun(remote.RemoteRun):
    """One allocation per attempt: submitted (or the one we are in), waited for, used, released."""

    option = "--nodes"
    warm_after_job = False
    final_errors = ("timed out",)  # a lost node is a reason to submit again, onto other nodes

    def __init__(self, spec: JobSpec, launcher: "SlurmLauncher"):
        super().__init__(spec, [], launcher)
        self.slurm_id: str | None = None
        self.inside = os.environ.get("SLURM_JOB_ID")  # a notebook inside an allocation uses it

    def open_links(self) -> list[remote.Link]:
        return [SlurmLink(node, host, self, self.inbox) for node, host in enumerate(self.hosts)]

    def _attempt(self, attempt: int) -> tuple[str, str | None, list]:
        job = self.job
        hosts = self._allocation(attempt)
        if hosts is None:
            self._release()
            return "stopped", self._stop_reason, []
        if isinstance(hosts, str):
            return "failed", hosts, []
        try:
            self.hosts = hosts[:self.spec.nodes]
            self.conns = []
            self.inbox = queue.Queue()  # the last allocation's links may still say they closed
            self._links_closed.clear()
            try:
                self.preflight()
            except SpecError as e:
                return "failed", str(e), []
            job.update_status(hosts=self.hosts, host_names=[c.hello.get("hostname") for c in self.conns],
                              slurm_state="RUNNING", pending_reason=None)
            state, error, codes = super()._attempt(attempt)
        finally:
            self.close_all()
            ended = self._release()
        if state == "failed" and ended:
            error = f"Slurm ended allocation {self.slurm_id}: {ended}" + (f"\n{error}" if error else "")
        return state, error, codes

    def _allocation(self, attempt: int):
        """The allocated host names; None when stopped while waiting; a string: why there is none."""
        job = self.job
        if self.inside:
            self.slurm_id = self.inside
            fields = job_state(self.inside)
            job.update_status(slurm_job_id=self.inside, slurm_state="RUNNING", slurm_inside=True)
            return hostnames(fields.get("NodeList") or os.environ.get("SLURM_JOB_NODELIST", ""))
        p = run(sbatch_argv(self.spec, job.name), stdin=HOLDER)
        if p.returncode != 0:
            return f"sbatch refused the job: {p.stderr.strip()}"
        self.slurm_id = p.stdout.strip().split(";")[0]
        job.update_status(slurm_job_id=self.slurm_id, slurm_state="PENDING", state="pending",
                          slurm_jobs=(job.status.get("slurm_jobs") or []) + [self.slurm_id])
        while not self._stop.is_set():
            fields = job_state(self.slurm_id)
            state = fields.get("JobState", "")
            if state == "RUNNING":
                return hostnames(fields.get("NodeList", ""))
            if state and state not in ("PENDING", "CONFIGURING"):
                return f"Slurm job {self.slurm_id} ended while it waited in the queue: {state} ({fields.get('Reason')})"
            reason = fields.get("Reason")
            if reason != job.status.get("pending_reason"):
                job.update_status(pending_reason=reason)
            self._stop.wait(POLL)
        return None

    def _release(self) -> str | None:
        """Cancel our allocation (never one we were started inside); what Slurm says ended it, if it
        was not us (TIMEOUT, PREEMPTED, NODE_FAIL, ...)."""
        if self.slurm_id is None or self.inside:
            return None
        fields = job_state(self.slurm_id)
        deadline = time.monotonic() + 10
        while fields.get("JobState") == "COMPLETING" and time.monotonic() < deadline:  # Slurm ending it: why?
            time.sleep(0.3)
            fields = job_state(self.slurm_id)
        state = fields.get("JobState", "")
        ended = None
        if state and state not in ("RUNNING", "PENDING", "CONFIGURING", "COMPLETING", "COMPLETED", "CANCELLED"):
            ended = f"{state} ({fields.get('Reason', 'None')})"
        subprocess.run(["scancel", self.slurm_id], capture_output=True, timeout=COMMAND_TIMEOUT)
        self.job.update_status(slurm_state=state or "ENDED")
        return ended

    def kill_now(self) -> None:
        super().kill_now()
        if self.slurm_id is not None and not self.inside:
            try:
                subprocess.run(["scancel", self.slurm_id], capture_output=True, timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass


class SlurmLauncher:
    """Runs a JobSpec in a Slurm allocation, one node per allocated node."""

    def __init__(self, sigint_grace: float = 3.0, sigterm_grace: float = 2.0):
        self.sigint_grace = sigint_grace
        self.sigterm_grace = sigterm_grace

    def resolve(self, spec: JobSpec) -> JobSpec:
        options = slurm_options(spec)
        args = extra_args(options)
        gpus = gpus_asked(args)
        if spec.backend == "nccl" and not gpus:
            raise SpecError("--backend", "nccl needs GPUs and the request asks Slurm for none. "
                                         "Fix: --slurm-args=\"--gpus-per-node=N\" (or --backend smddp)")
        spec = prepared(spec, nodes=1, procs_per_node=spec.procs_per_node or gpus or 1)
        if os.environ.get("SLURM_JOB_ID"):
            return spec  # inside an allocation: nothing is submitted
        p = run(sbatch_argv(spec, spec.name, test_only=True), stdin=HOLDER)
        if p.returncode != 0:
            raise explain_refusal(spec, p.stderr)
        if options.get("time"):  # Slurm queues an over-long job forever (PartitionTimeLimit) unless told to refuse
            asked, limit = minutes(options["time"]), partition_limit(options.get("partition"))
            if limit is not None and limit[1] is not None and asked is not None and asked > limit[1]:
                raise SpecError("--time", f"{options['time']!r} is over partition {limit[0]}'s limit of "
                                          f"{limit[1]:g} minute(s). Fix: --time {limit[1]:g} or less, or another "
                                          "--partition (`sinfo -o '%P %l'` shows each partition's limit)")
        return spec

    def start(self, spec: JobSpec, push: dict | None = None) -> Job:
        spec = self.resolve(spec)
        push_bytes = pickle_push(spec.push, push or {})
        job = create_job(spec, push_bytes, hosts=[], slurm_job_id=None, pending_reason=None)
        run_ = SlurmRun(spec, self)
        run_.attach(job, push_bytes)
        job.supervisor = run_
        run_.start()
        return job
