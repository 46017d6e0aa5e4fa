"""The Slurm target: `%%sdp_train --target slurm --nodes 4` runs the cell in a Slurm allocation.

`sbatch` asks for the allocation (one task per node) with a holder script that keeps it while the
notebook uses it; once Slurm runs it, `srun --overlap` starts the per-host agent (launch/host/agent.py)
on each allocated node, reached over srun's stdin/stdout exactly as the SSH target reaches it over
ssh's, so output, metrics, the result, Stop and "no orphans" are the agent run's (launch/kernel/agent_run/).
Inside an allocation already (a notebook in `salloc`, or on a compute node: $SLURM_JOB_ID set) the
agents run in that allocation and nothing is submitted.

Before anything is queued: `sbatch` on the PATH, and the request checked by `sbatch --test-only`
(partition, node count, time limit, account, QOS), its answer turned into the option to fix. While
the job waits in the queue the job view says so with Slurm's reason (Resources, Priority, ...).
When the job ends the holder script ends the allocation with the job's outcome, so Slurm's own record
(`squeue --states=all`, `sacct`) tells the truth: a job that succeeded leaves COMPLETED, one that failed
FAILED (the holder is told by a signal to its batch step: `scancel --batch --signal=USR1|USR2`, which
cancels nothing). Stop cancels the allocation (`scancel`: CANCELLED); the holder also ends it when no
agent has run in it for HOLD_IDLE seconds (FAILED, exit code 3), so a notebook killed outright leaves no
allocation behind. A job Slurm ended (time limit, preemption, node failure) fails with that reason;
--max-restarts submits again.
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

from sdp_jupyter.launch.kernel.agent_run import run as agent_run
from sdp_jupyter.launch.kernel.job import Job
from sdp_jupyter.launch.kernel.preparation import create_job, prepared
from sdp_jupyter.launch.kernel.push import pickle_push
from sdp_jupyter.launch.targets.ssh.launcher import CONNECTED, SSHLink
from sdp_jupyter import backends
from sdp_jupyter.launch.spec import JobSpec, SpecError

from sdp_jupyter.launch.targets.slurm import KEYS  # noqa: E402  (the record's keys)
POLL = 1.0        # seconds between looks at the queue while the job waits
HOLD_IDLE = 20    # the holder ends the allocation after this many seconds without an agent in it
HOLD_FIRST = 120  # ... or when no agent came this long after it started (the notebook went away)
COMMAND_TIMEOUT = 30

# The allocation's batch script: hold the nodes while the notebook's agents (srun steps) run in it, and
# end with the job's outcome, which Slurm records as the allocation's state: SIGUSR1 from the notebook
# (the job succeeded) exits 0 (COMPLETED), SIGUSR2 (it failed) exits 1 (FAILED). No agent for a while
# (the notebook went away without a word) exits ABANDONED (FAILED). `sleep & wait` so a signal is
# handled at once (a shell runs its traps only between commands, and `wait` is cut short by them).
SUCCEEDED_SIGNAL, FAILED_SIGNAL = "USR1", "USR2"
ABANDONED = 3
HOLDER = f"""#!/bin/sh
# sdp_jupyter --target slurm: holds this allocation while the notebook's agents run in it
trap 'kill $! 2>/dev/null; exit 0' {SUCCEEDED_SIGNAL}
trap 'kill $! 2>/dev/null; exit 1' {FAILED_SIGNAL}
seen=0; idle=0
while :; do
  sleep 2 & wait $!
  if squeue -h -s -j "$SLURM_JOB_ID" -o %i 2>/dev/null | grep -q -v -e '\\.batch$' -e '\\.extern$'; then
    seen=1; idle=0
  else
    idle=$((idle + 2))
  fi
  if [ $seen = 1 ] && [ $idle -ge {HOLD_IDLE} ]; then exit {ABANDONED}; fi
  if [ $seen = 0 ] && [ $idle -ge {HOLD_FIRST} ]; then exit {ABANDONED}; fi
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


# What Slurm's commands say when this machine reaches no controller (lower case): no configuration at all
# (no slurm.conf, and no DNS SRV record naming a controller for Slurm's "configless" lookup), a
# configuration they cannot use, or a controller that does not answer.
_NO_CONFIGURATION = ("could not establish a configuration source", "fetch_config", "resolve_ctls_from_dns_srv")
_BAD_CONFIGURATION = ("unable to process configuration file", "s_p_parse_file", "parsing error at unrecognized key")
_NO_ANSWER = ("unable to contact slurm controller", "unable to establish connection", "connection refused",
              "socket timed out", "communication connection failure", "connection timed out")
NO_CONTROLLER_FIX = ("Fix: run the notebook on the cluster's login node (where `sinfo` answers) or inside an "
                     "allocation (salloc), or point SLURM_CONF at the cluster's slurm.conf (docs/slurm.md)")


def _last_said(said: str) -> str:
    """The last line a Slurm command wrote, without its `sbatch: error:` / `sbatch: fatal:` prefix."""
    lines = [line.strip() for line in said.strip().splitlines() if line.strip()]
    return re.sub(r"^\w+: (?:error|fatal): ", "", lines[-1]) if lines else ""


def no_controller(said: str) -> str | None:
    """Why this machine reaches no Slurm controller, read from what sbatch (or sinfo, squeue) wrote to
    stderr; None when the words are not those (a controller answered: it refused the request itself)."""
    low = said.lower()
    last = _last_said(said)
    if any(words in low for words in _NO_CONFIGURATION):
        return ("no Slurm configuration here: no slurm.conf (SLURM_CONF, or the default /etc/slurm/slurm.conf), "
                f"and no DNS SRV record names a controller; Slurm says: {last}")
    if any(words in low for words in _BAD_CONFIGURATION):
        where = os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf"
        return f"the Slurm configuration {where} cannot be used; Slurm says: {last}"
    if any(words in low for words in _NO_ANSWER):
        named = controllers()
        return (f"the controller{' at ' + ', '.join(named) if named else ''} does not answer from here; "
                f"Slurm says: {last}")
    return None


def controllers() -> list[str]:
    """The controller host(s) the Slurm configuration here names (SlurmctldHost, or the older ControlMachine)."""
    try:
        text = open(os.environ.get("SLURM_CONF") or "/etc/slurm/slurm.conf").read()
    except OSError:
        return []
    return re.findall(r"^\s*(?:SlurmctldHost|ControlMachine)\s*=\s*(\S+)", text, flags=re.M | re.I)


def no_controller_sentence(why: str) -> str:
    """What a machine that reaches no Slurm controller is told, with the fix."""
    return f"this machine reaches no Slurm controller ({why}). {NO_CONTROLLER_FIX}"


def unreachable(why: str) -> SpecError:
    """The error for a machine that reaches no Slurm controller: the target is named, not an option."""
    return SpecError("--target", no_controller_sentence(why))


def run(argv: list[str], timeout: float = COMMAND_TIMEOUT, stdin: str | None = None) -> subprocess.CompletedProcess:
    """A Slurm command; SpecError naming the fix when Slurm's commands are not here or reach no controller."""
    if shutil.which(argv[0]) is None:
        raise SpecError("--target", f"`{argv[0]}` is not on the PATH: this machine is not a Slurm login or "
                                    "compute node. Fix: run the notebook on a machine where `sbatch` works "
                                    "(docs/slurm.md)")
    conf = os.environ.get("SLURM_CONF")
    if conf and not os.path.isfile(conf):  # Slurm's commands would retry reading it for a minute
        raise unreachable(f"SLURM_CONF={conf} names no file")
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, input=stdin)
    except subprocess.TimeoutExpired:
        raise unreachable(f"`{' '.join(argv[:2])}` did not answer within {timeout:g} s") from None


def sbatch_argv(spec: JobSpec, name: str, test_only: bool = False) -> list[str]:
    options = slurm_options(spec)
    # An elastic job asks for MAX nodes and keeps its allocation when one of them fails (--no-kill). Not
    # --nodes=MIN-MAX: Slurm's cons_tres selector then allocates MIN nodes even when MAX are free.
    nodes = [f"--nodes={spec.nodes}"] + (["--no-kill"] if spec.elastic else [])
    argv = ["sbatch", "--parsable", f"--job-name=sdp-{name}", *nodes, "--ntasks-per-node=1",
            "--output=/dev/null", "--open-mode=append"]
    for key, flag in (("partition", "--partition"), ("account", "--account"), ("time", "--time")):
        if options.get(key):
            argv.append(f"{flag}={options[key]}")
    if test_only:
        argv.append("--test-only")
    return argv + extra_args(options)


def explain_refusal(spec: JobSpec, said: str) -> SpecError:
    """sbatch's refusal as the option to fix; a machine that reaches no controller is said to be one."""
    why = no_controller(said)
    if why:
        return unreachable(why)
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
    if options.get("args"):
        return SpecError("--slurm-args", f"sbatch refuses the request: {text}")
    return SpecError("--target", f"Slurm refuses the job: {text}. Fix: what Slurm names, with --partition, "
                                 "--account, --time or --slurm-args (`sbatch --test-only` shows the same answer)")


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
        said = agent_run.Link.diagnose(self, code, python)
        if said.startswith("sdp_jupyter is not installed"):
            return said + " (an environment the compute nodes share; docs/slurm.md)"
        return said.replace("the agent did not start", "srun could not run the agent")


class SlurmRun(agent_run.AgentRun):
    """One allocation per attempt: submitted (or the one we are in), waited for, used, released. An
    elastic job keeps its allocation from one formation to the next: a node Slurm takes out of it
    (set down, its slurmd gone) is left out, and the job ends the allocation when it ends."""

    option = "--nodes"
    warm_after_job = False
    final_errors = ("timed out",)  # a lost node is a reason to submit again, onto other nodes

    def __init__(self, spec: JobSpec, launcher: "SlurmLauncher"):
        super().__init__(spec, [], launcher)
        self.slurm_id: str | None = None
        self.inside = os.environ.get("SLURM_JOB_ID")  # a notebook inside an allocation uses it

    def open_links(self) -> list[agent_run.Link]:
        return [SlurmLink(node, host, self, self.inbox) for node, host in enumerate(self.hosts)]

    def reopen(self, node: int, inbox: queue.Queue) -> agent_run.Link:
        """An elastic job's lost node, tried again in the same allocation (srun refuses a node Slurm took
        out of it: tried again later, the job goes on without it)."""
        return SlurmLink(node, self.hosts[node], self, inbox)

    def attempt(self, attempt: int) -> tuple[str, str | None, list]:
        if self.spec.elastic and self.conns:  # a re-formation in the same allocation
            return super().attempt(attempt)
        job = self.job
        hosts = self._allocation(attempt)
        if hosts is None:
            self._release()
            return "stopped", self._stop_reason, []
        if isinstance(hosts, str):
            return "failed", hosts, []
        state = "failed"  # until the attempt says otherwise (an exception, a refused preflight)
        keep = False  # an elastic job's allocation stays for its next formation (elastic_ended releases it)
        try:
            self.hosts = hosts[:self.spec.nodes]
            self.conns = []
            self.inbox = queue.Queue()  # the last allocation's links may still say they closed
            self._links_closed.clear()
            try:
                self.preflight()
            except SpecError as e:
                return "failed", str(e), []
            job.update_status(hosts=self.hosts, host_names=[(c.hello or {}).get("hostname") for c in self.conns],
                              slurm_state="RUNNING", pending_reason=None)
            if self.membership is not None:
                self.members = self.membership.formed()
            state, error, codes = super().attempt(attempt)
            keep = self.membership is not None
        finally:
            ended = None
            if not keep:
                self.close_all()
                ended = self._release(state)
        if state == "failed" and ended:
            error = f"Slurm ended allocation {self.slurm_id}: {ended}" + (f"\n{error}" if error else "")
        return state, error, codes

    def _allocation(self, attempt: int):
        """The allocated host names; None when stopped while waiting; a string: why there is none."""
        job = self.job
        if self.inside:
            self.slurm_id = self.inside
            fields = job_state(self.inside)
            job.update_status(slurm_job_id=self.inside, allocation=f"slurm job {self.inside}", slurm_state="RUNNING",
                              slurm_inside=True)
            return hostnames(fields.get("NodeList") or os.environ.get("SLURM_JOB_NODELIST", ""))
        p = run(sbatch_argv(self.spec, job.name), stdin=HOLDER)
        if p.returncode != 0:
            why = no_controller(p.stderr)
            if why:
                return no_controller_sentence(why)
            return f"sbatch refused the job: {p.stderr.strip()}"
        self.slurm_id = p.stdout.strip().split(";")[0]
        job.update_status(slurm_job_id=self.slurm_id, allocation=f"slurm job {self.slurm_id}", slurm_state="PENDING",
                          state="pending",
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

    def _release(self, outcome: str = "stopped") -> str | None:
        """End our allocation (never one we were started inside) as Slurm should record it: the holder
        exits 0 for a job that succeeded (COMPLETED) or 1 for one that failed (FAILED); anything else
        (Stop, or a holder that does not answer) is cancelled (CANCELLED). Returns what Slurm says ended
        the allocation, if it was not us (TIMEOUT, PREEMPTED, NODE_FAIL, ...)."""
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
        if state == "RUNNING" and outcome in ("succeeded", "failed"):
            state = self._end_holder(SUCCEEDED_SIGNAL if outcome == "succeeded" else FAILED_SIGNAL)
        if state in ("", "RUNNING", "PENDING", "CONFIGURING"):
            subprocess.run(["scancel", self.slurm_id], capture_output=True, timeout=COMMAND_TIMEOUT)
            state = state and "CANCELLED"
        self.job.update_status(slurm_state=state or "ENDED")
        return ended

    def _end_holder(self, signal_name: str, wait: float = 5.0) -> str:
        """Signal the holder (its batch step only: `--batch` cancels nothing) to exit with the job's
        outcome; Slurm's state for the allocation once it has ended, or RUNNING if it did not end in
        `wait` seconds (then the caller cancels it)."""
        try:
            p = subprocess.run(["scancel", "--batch", f"--signal={signal_name}", self.slurm_id],
                               capture_output=True, timeout=COMMAND_TIMEOUT)
        except subprocess.TimeoutExpired:
            return "RUNNING"
        if p.returncode != 0:
            return "RUNNING"
        deadline = time.monotonic() + wait
        state = "RUNNING"
        while time.monotonic() < deadline:
            state = job_state(self.slurm_id).get("JobState", "")
            if state not in ("RUNNING", "COMPLETING"):
                return state or "ENDED"
            time.sleep(0.1)
        return state

    def elastic_ended(self, state: str) -> None:
        self.close_all()
        self._release(state)

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
        short = backends.gpu_shortfall(spec.backend, spec.procs_per_node or gpus or 1, gpus, "the request to Slurm",
                                       '--slurm-args="--gpus-per-node=N" (or --backend smddp)')
        if short:
            raise SpecError(*short)
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
