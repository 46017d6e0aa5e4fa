"""Reading settings from the environment: one parser, one truth table, one registry.

Every numeric or boolean setting (SDP_TIMEOUT, SDP_CHUNK_BYTES, SDP_FAST_EXIT, ...) goes through
these functions (`environ=` reads another mapping, e.g. a worker's environment being built), so a bad value fails the same way everywhere: an error that names the variable,
the value and what is allowed. Unset or empty means "use the default". Every SDP_* name is in
VARIABLES (a read of one that is not raises KeyError), the table the reference page is made from.

setup.py reads its build switches with these same functions, loading this file by its path before the
package is built: keep it standard library only, with no import of the package.
"""
from __future__ import annotations

import math
import os

TRUE = frozenset({"1", "true", "yes", "on"})
FALSE = frozenset({"0", "false", "no", "off"})


def _raw(name: str, environ=None) -> str | None:
    v = (os.environ if environ is None else environ).get(registered(name))
    return None if v is None or str(v).strip() == "" else str(v).strip()


def parse_bool(value, name: str = "value") -> bool:
    """True/False from 1/0, true/false, yes/no, on/off (any case) or a bool; else ValueError."""
    if isinstance(value, bool):
        return value
    low = str(value).strip().lower()
    if low in TRUE:
        return True
    if low in FALSE:
        return False
    raise ValueError(f"{name}={value!r} is not a boolean: use one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, *, min: int | None = None, environ=None) -> int:
    v = _raw(name, environ)
    if v is None:
        return default
    try:
        n = int(v, 10)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not an integer") from None
    if min is not None and n < min:
        raise ValueError(f"{name}={v!r} must be at least {min}")
    return n


def env_float(name: str, default: float, *, min: float | None = None, finite: bool = True,
              environ=None) -> float:
    """A float setting; `finite` refuses nan and inf (a deadline of nan would never fire)."""
    v = _raw(name, environ)
    if v is None:
        return default
    try:
        x = float(v)
    except ValueError:
        raise ValueError(f"{name}={v!r} is not a number") from None
    if finite and not math.isfinite(x):
        raise ValueError(f"{name}={v!r} must be a finite number")
    if min is not None and not x >= min:
        raise ValueError(f"{name}={v!r} must be at least {min:g}")
    return x


def env_bool(name: str, default: bool, *, environ=None) -> bool:
    v = _raw(name, environ)
    return default if v is None else parse_bool(v, name)


def env_str(name: str, default: str | None = None, *, environ=None) -> str | None:
    """A text setting exactly as the environment holds it (`default` when unset), like
    `os.environ.get`; an SDP_* name must be in VARIABLES."""
    return (os.environ if environ is None else environ).get(registered(name), default)


# ----------------------------------------------------------------------------- the registry
# Every SDP_* variable any part of the toolkit reads or sets: the reference page
# (docs/reference/environment.md) is generated from this table by tools/gen_reference.py, and
# tests/house/test_reference.py keeps it and the code in step in both directions.

#: where a variable takes effect, in the order the reference page lists them
WHERE = {
    "kernel": "the notebook kernel or `sdp-train` that launches jobs",
    "rank": "every rank of a job (the training process)",
    "engine": "the C++ engine, read when a process group starts",
    "agent": "the per-host agent of SSH, Ray and Slurm jobs",
    "build": "`setup.py`, when the engine is compiled",
    "tests": "the test suite's own tools",
}


class Var:
    """One SDP_* variable: its type, its default as a user reads it, where it takes effect, one line
    of meaning. `internal`: the toolkit sets it for the processes it starts (a user does not)."""

    __slots__ = ("name", "type", "default", "where", "meaning", "internal")

    def __init__(self, name: str, type: str, default: str, where: str, meaning: str, internal: bool = False):
        if where not in WHERE:
            raise ValueError(f"{name}: where={where!r} is not one of {', '.join(WHERE)}")
        self.name, self.type, self.default, self.where = name, type, default, where
        self.meaning, self.internal = meaning, internal

    def __repr__(self) -> str:
        return f"Var({self.name!r}, {self.where!r}{', internal' if self.internal else ''})"


_PARALLEL = "hybrid parallelism, read by `sdp_jupyter.parallel.setup()`; set by %%sdp_train's "

VARIABLES: dict[str, Var] = {v.name: v for v in (
    # --- the engine and the rank's communicator
    Var("SDP_TIMEOUT", "float (seconds)", "300", "rank",
        "deadline of every wait of the engine and the rendezvous; a collective that misses it fails and names "
        "the ranks that did not arrive"),
    Var("SDP_FLIGHT_ENTRIES", "int (>= 0)", "2048", "engine",
        "collectives each engine keeps in its flight recorder's ring (0: off); dumped into the job directory "
        "after a failure, on a stop, when a wait passes SDP_HANG_WARN_S and on request (docs/failures.md)"),
    Var("SDP_HANG_WARN_S", "float (seconds)", "20", "rank",
        "a collective waited on this long, or a rank idle this long after its last one, is reported (who waits "
        "where, who has not arrived) while the job runs, long before SDP_TIMEOUT fails it"),
    Var("SDP_PREEMPT_GRACE_S", "float (seconds, >= 0)", "60", "rank",
        "after SIGTERM, how long a rank that registered sdp_jupyter.checkpoint.on_preemption may take to reach "
        "its next step boundary (where the hooks run) before it leaves without them"),
    Var("SDP_FLIGHT_DIR", "str (folder)", "unset: the job directory's metrics/", "rank",
        "where a rank writes its flight recorder file when no job directory is set (plain torchrun)"),
    Var("SDP_FLIGHT_POLL_S", "float (seconds)", "1", "rank",
        "how often each rank's flight watchdog looks at its engines and for a dump request"),
    Var("SDP_ARRIVALS_S", "float (seconds)", "5", "rank",
        "how often each rank writes when it came to its recent collectives and how long it waited in them "
        "(the stragglers analysis and the dashboard's per-rank panel)"),
    Var("SDP_CHUNK_BYTES", "int (bytes, >= 4096)", "4194304", "rank",
        "engine chunk: the pipeline grain and the size of each shared-memory slot; the same on every rank"),
    Var("SDP_SPIN", "int (>= -1)", "2000", "rank",
        "pause-loop iterations in a node barrier before yielding, then sleeping; 0 also makes receives "
        "sleep at once instead of polling (-1: the engine's default)"),
    Var("SDP_BIND_ADDR", "str (address)", "loopback for a local job, else the interface that reaches MASTER_ADDR",
        "rank", "address the engine listens on"),
    Var("SDP_JOB_SECRET", "str (>= 16 bytes)", "set per job by the launchers", "rank",
        "secret every rendezvous and engine connection proves it knows; the same on every rank"),
    Var("SDP_ALLOW_UNAUTHENTICATED", "bool", "0", "rank",
        "1 lets a job across hosts run without SDP_JOB_SECRET (anyone who reaches its ports can join; "
        "warns on every rank)"),
    Var("SDP_SOCKET_BUFFER", "int (bytes, 0 to 2^30)", "0", "engine",
        "SO_SNDBUF/SO_RCVBUF between node leaders and on the mailbox's connections (0: the kernel's autotuning)"),
    Var("SDP_PIPELINE_DEPTH", "int (1 or 2)", "2", "engine",
        "chunks in flight on the one-rank-per-node TCP path"),
    Var("SDP_NO_SIMD", "bool", "0", "engine", "1 forces the portable reduction kernels instead of AVX2/F16C"),
    Var("SDP_PORT_RANGE", "str (LO-HI)", "unset: any free port", "engine",
        "the ports a job listens on come from this range, both ends included: each node's engine listener, each "
        "rank's mailbox listener and the MASTER_PORT our launchers pick (open it in the hosts' firewall; parsed "
        "by sdp_jupyter._net.port_range)"),
    Var("SDP_NO_CMA", "bool", "0", "engine",
        "1 sends large gather, scatter and all_to_all within a node through shared memory instead of reading "
        "the peers' memory; on any one rank it holds for the whole node"),
    # --- torch
    Var("SDP_BACKEND", "str", "smddp", "rank",
        "the job's torch.distributed backend (--backend: smddp, gloo, nccl), used by `init_process_group()` "
        "without a backend"),
    Var("SDP_FUSION_THRESHOLD", "int (bytes, >= 1024)", "4194304", "rank",
        "bytes per fusion buffer of the engine's DDP wrapper"),
    Var("SDP_STAGE_CHUNK_BYTES", "int (bytes, >= 4096)", "4194304", "rank",
        "bytes per chunk in which a larger CUDA tensor is staged through pinned host memory"),
    # --- the job a rank belongs to
    Var("SDP_JOB_DIR", "str (path)", "set per job", "rank",
        "the job directory (absolute): logs, metrics, the result", internal=True),
    Var("SDP_JOB_NAME", "str", "set per job", "rank", "the job's name", internal=True),
    Var("SDP_NUM_NODES", "int", "set per job", "rank", "the job's number of nodes", internal=True),
    Var("SDP_CHECKPOINT_DIR", "str (path)", "<job dir>/checkpoints in a job, ./checkpoints outside one", "rank",
        "where `sdp_jupyter.checkpoint` saves and finds checkpoints (--checkpoint-dir)"),
    Var("SDP_RESTART", "int", "0", "rank", "attempt number: 0, then 1, 2, ... after each --max-restarts restart "
        "or elastic re-formation", internal=True),
    Var("SDP_ELASTIC", "flag", "unset", "rank", "set to 1 in an elastic job (--nodes MIN:MAX)", internal=True),
    Var("SDP_CHECKPOINT_PER_NODE", "flag", "unset", "rank", "set to 1 in a job whose nodes run on hosts of their "
        "own (SSH, Ray, Slurm, more than one node) and in every elastic job: `sdp_jupyter.checkpoint` keeps a "
        "copy on every node and load() gives every rank node 0's", internal=True),
    Var("SDP_SCRIPT", "str (path)", "set per job", "rank", "the script the worker runs", internal=True),
    Var("SDP_LAUNCHER_PID", "int", "set per job", "rank",
        "the launching process: a worker or sampler whose parent is not this pid exits at once", internal=True),
    Var("SDP_FAST_EXIT", "bool", "1", "rank",
        "0 turns off the worker's fast exit (after atexit handlers and flushing files it skips the "
        "interpreter's teardown)"),
    Var("SDP_SESSION_CONNECT_TIMEOUT", "float (seconds)", "300", "rank",
        "how long a session's ranks wait for each other's rendezvous store"),
    Var("SDP_SESSION_STORE", "bool", "unset", "rank",
        "set on a session whose dead ranks are replaced: its store runs in a process of its own "
        "(launch/host/session_store.py) and rank 0 is a client like the others", internal=True),
    Var("SDP_SESSION_CHANNEL", "str", "unset", "rank",
        "a session's rank: the abstract Unix socket of its node agent's session relay, where it reads its "
        "cells and writes its answers (launch/host/session_relay.py); the launcher sets it to 1 in a "
        "session's spec to ask the agents for one", internal=True),
    Var("SDP_SESSION_JOIN", "str (generation:cell:members)", "unset", "rank",
        "set on a session's rank started again after it died: it joins the process group the others "
        "make again in that cell", internal=True),
    Var("SDP_HEAL", "flag", "unset", "rank", "set to 1 in a --heal job: sdp_jupyter.heal.Healer may run there",
        internal=True),
    Var("SDP_HEAL_JOIN", "flag", "unset", "rank", "set to 1 on a --heal job's rank started again after it died: "
        "its Healer joins the others at their next step boundary", internal=True),
    Var("SDP_HEAL_WAIT", "float (seconds)", "60", "rank",
        "how long a --heal job's rank whose collective failed waits for the launcher's next membership record "
        "before it raises the collective's error"),
    # --- hybrid parallelism (ParallelConfig.env() / from_env())
    Var("SDP_TP", "int", "1", "rank", _PARALLEL + "--tp: tensor-parallel degree"),
    Var("SDP_PP", "int", "1", "rank", _PARALLEL + "--pp: pipeline-parallel degree"),
    Var("SDP_MICROBATCHES", "int", "1", "rank", _PARALLEL + "--microbatches: microbatches per batch"),
    Var("SDP_ACTIVE_MICROBATCHES", "int", "unset (no cap)", "rank",
        _PARALLEL + "--active-microbatches: cap on microbatches in flight per stage"),
    Var("SDP_PIPELINE_SCHEDULE", "str", "1f1b", "rank",
        _PARALLEL + "--pipeline-schedule: 1f1b, gpipe or interleaved"),
    Var("SDP_VIRTUAL_STAGES", "int", "1", "rank",
        _PARALLEL + "--virtual-stages: chunks per rank with the interleaved schedule"),
    Var("SDP_SHARD_OPTIMIZER", "str", "none", "rank",
        _PARALLEL + "--shard-optimizer: none, optimizer, gradients or full"),
    Var("SDP_CHECKPOINT_ACTIVATIONS", "str", "none", "rank",
        _PARALLEL + "--checkpoint-activations: none, layer or selective"),
    Var("SDP_OFFLOAD_ACTIVATIONS", "bool", "0", "rank", _PARALLEL + "--offload-activations"),
    Var("SDP_SEQUENCE_PARALLEL", "bool", "1", "rank", _PARALLEL + "--no-sequence-parallel (0)"),
    # --- SageMaker
    Var("SDP_ENGINE", "str (sdp or aws)", "set per job", "rank",
        "on SageMaker with backend smddp: our engine (sdp, built in the container) or AWS's smdistributed (aws)",
        internal=True),
    Var("SDP_IMAGE_URI", "str", "set per job", "rank",
        "the SageMaker training image, named in errors of the container's engine build", internal=True),
    Var("SDP_TARGET", "str", "set per job", "rank", "sagemaker inside a SageMaker training job", internal=True),
    Var("SDP_SMDDP_PROVIDER", "str", "set per job", "rank",
        "who provides the smddp backend in a SageMaker job: sdp_jupyter or smdistributed", internal=True),
    Var("SDP_SAGEMAKER_POLL_INTERVAL", "float (seconds, >= 0.01)", "10", "kernel",
        "how often a SageMaker job's status is polled"),
    Var("SDP_SAGEMAKER_MOTO", "str (1 or 0)", "unset: the stand-in only where there are no AWS credentials", "kernel",
        "notebooks/04_sagemaker.ipynb: 1 runs it against the local moto stand-in even where AWS credentials "
        "exist, 0 sends it to AWS"),
    Var("SDP_SAGEMAKER_ROLE", "str (IAM role ARN)", "none: needed against AWS", "kernel",
        "notebooks/04_sagemaker.ipynb against a real account: the role SageMaker assumes (its --role)"),
    Var("SDP_SAGEMAKER_BUCKET", "str (S3 bucket)", "none: needed against AWS", "kernel",
        "notebooks/04_sagemaker.ipynb against a real account: the bucket of its train channel and output "
        "(its --bucket)"),
    Var("SDP_SAGEMAKER_INSTANCE", "str (instance type)", "ml.p4d.24xlarge", "kernel",
        "notebooks/04_sagemaker.ipynb against a real account: the instance type (backend smddp with 8 processes "
        "per host on ml.p4d/ml.p4de.24xlarge, else nccl with 1)"),
    # --- the kernel
    Var("SDP_JOBS_DIR", "str (path)", "./sdp_jobs", "kernel", "root of job directories (--jobs-dir wins)"),
    Var("SDP_WARM", "bool", "unset", "kernel",
        "1/0: start jobs warm/cold by default (an explicit --warm or --cold wins)"),
    Var("SDP_WARM_OWNER", "int", "set by the kernel", "kernel",
        "the process a warm pool belongs to", internal=True),
    # --- the agent
    Var("SDP_STOPPED_RANK_S", "float (seconds, >= 0)", "10", "agent",
        "a rank stopped by a signal (SIGSTOP, state T) this long is killed and named, instead of holding its "
        "peers' collectives until SDP_TIMEOUT (0: never); read where the ranks are started (each host's agent, "
        "the kernel for a local job), from the job's --env first, then that process's environment"),
    Var("SDP_AGENT_DIR", "str (path)", "~/.cache/sdp_jupyter/jobs", "agent",
        "where the per-host agent keeps the job directories of its host"),
    Var("SDP_AGENT_ADDR", "str (address)", "the address this host was reached on over SSH, else its host name's", "agent",
        "the address the other hosts of a job reach this host on (set on Ray nodes)", internal=True),
    # --- the build
    Var("SDP_PORTABLE", "bool", "0", "build",
        "1: no intrinsics at all (no AVX2/F16C kernels, no pause instruction): a build for any CPU"),
    Var("SDP_BUILD_QUICK", "bool", "0", "build", "1: -O0, about a third of the build time, slower code"),
    Var("SDP_BUILD_JOBS", "int (>= 0)", "one per CPU", "build", "compile this many files at once (0: one per CPU)"),
    Var("SDP_SANITIZE", "bool", "0", "build",
        "1: AddressSanitizer + UndefinedBehaviorSanitizer (-O1, frame pointers; wins over SDP_BUILD_QUICK)"),
    # --- tests
    Var("SDP_CONFORMANCE_BACKEND", "str", "set by the runner", "tests",
        "the backend `python -m sdp_jupyter.testing.conformance` runs torch's suite against", internal=True),
    Var("SDP_TEST_PACKAGE_ROOT", "str (path)", "this checkout", "tests",
        "where the test ranks import sdp_jupyter from (another build of the engine)", internal=True),
)}


def registered(name: str) -> str:
    """`name`, if it is not an SDP_* name or is one in VARIABLES; else KeyError (register it first)."""
    if name.startswith("SDP_") and name not in VARIABLES:
        raise KeyError(f"{name} is not in sdp_jupyter._env.VARIABLES: register it (name, type, default, "
                       "where, meaning) so the reference page lists it")
    return name
