"""Start N real rank processes on this machine, laid out as nodes, and collect their results."""
from __future__ import annotations

import os
import pickle
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from sdp_jupyter._net import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
# SDP_TEST_PACKAGE_ROOT: where sdp_jupyter comes from for the ranks (a sanitizer or portable build
# of the engine, see tests/engine/test_native_builds.py); the repository by default.
ROOT = os.environ.get("SDP_TEST_PACKAGE_ROOT") or os.path.dirname(os.path.dirname(HERE))


@dataclass
class RankResult:
    rank: int
    returncode: int | None
    ok: bool
    value: object = None
    error: str = ""
    output: str = ""


def start_ranks(target: str, world: int, per_node: int, args=(), env=None, secret=None, wrap=None,
                master_addr: str = "127.0.0.1"):
    """`wrap(rank)` -> an argv prefix (e.g. a test host's nsenter) to start that rank under. Returns the
    processes and their own folder, which `collect` removes."""
    tmp = tempfile.mkdtemp(prefix="sdp-ranks-")
    args_path = os.path.join(tmp, "args.pkl")
    with open(args_path, "wb") as f:
        pickle.dump(tuple(args), f)
    port = free_port()
    secret = secrets.token_hex(16) if secret is None else secret
    procs = []
    for r in range(world):
        e = dict(os.environ)
        e.pop("PYTEST_CURRENT_TEST", None)
        e.update({
            "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r % per_node),
            "LOCAL_WORLD_SIZE": str(per_node), "GROUP_RANK": str(r // per_node),
            "MASTER_ADDR": master_addr, "MASTER_PORT": str(port),
            "SDP_JOB_SECRET": secret if not callable(secret) else secret(r),
            "SDP_TEST_ARGS": args_path, "PYTHONPATH": ROOT + os.pathsep + e.get("PYTHONPATH", ""),
        })
        if e["SDP_JOB_SECRET"] is None:  # a test of the plain-torchrun path: no launcher secret
            del e["SDP_JOB_SECRET"]
        if env:
            e.update({k: str(v) for k, v in (env(r) if callable(env) else env).items()})
        log = open(os.path.join(tmp, f"rank-{r}.log"), "w+")
        p = subprocess.Popen((wrap(r) if wrap else []) + [sys.executable, os.path.join(HERE, "rank_entry.py"), target,
                              os.path.join(tmp, f"result-{r}.pkl")],
                             stdout=log, stderr=subprocess.STDOUT, env=e, cwd=ROOT, start_new_session=True)
        p.log = log  # type: ignore[attr-defined]
        procs.append(p)
    return procs, tmp


def collect(procs, tmp, timeout: float = 120.0) -> list[RankResult]:
    """Wait for the ranks, read their results and logs, and remove `tmp` (each rank's output is in its
    RankResult): a full run starts thousands of ranks and once filled the disk with their folders."""
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    timed_out = [p for p in procs if p.poll() is None]
    for p in timed_out:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    results = []
    for r, p in enumerate(procs):
        p.log.seek(0)
        out = p.log.read()
        p.log.close()
        path = os.path.join(tmp, f"result-{r}.pkl")
        res = RankResult(r, p.returncode, False, output=out)
        if os.path.exists(path):
            with open(path, "rb") as f:
                d = pickle.load(f)
            res.ok, res.value, res.error = d["ok"], d.get("value"), d.get("error", "")
        elif p in timed_out:
            res.error = f"rank {r} did not finish within {timeout} s"
        results.append(res)
    shutil.rmtree(tmp, ignore_errors=True)
    return results


def run_ranks(target: str, world: int, per_node: int, args=(), env=None, timeout: float = 120.0, secret=None,
              wrap=None, master_addr: str = "127.0.0.1"):
    # a rank still running 10 s before the deadline prints every thread's stack into its log (the
    # failure message shows it): a hang seen once in a full run is then not a mystery
    dump = {"SDP_TEST_DUMP_AFTER": str(max(5.0, timeout - 10.0))}
    env_for = (lambda r: {**env(r), **dump}) if callable(env) else {**(env or {}), **dump}
    procs, tmp = start_ranks(target, world, per_node, args, env_for, secret, wrap=wrap, master_addr=master_addr)
    return collect(procs, tmp, timeout)


def assert_all_ok(results, what: str = ""):
    """The ranks' values; `what` (e.g. "the gloo run") starts each failed rank's line."""
    bad = [r for r in results if not r.ok]
    assert not bad, "\n".join(f"{what + ': ' if what else ''}rank {r.rank} (exit {r.returncode}): {r.error}\n"
                               f"{r.output[-3000:]}" for r in bad)
    return [r.value for r in results]
