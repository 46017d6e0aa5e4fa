"""PyTorch's own distributed test suite, run for smddp and for gloo, side by side.

    python -m sdp_jupyter.testing.conformance                      # the default selection, world size 2
    python -m sdp_jupyter.testing.conformance -k scatter -k gather # tests whose name holds any pattern
    python -m sdp_jupyter.testing.conformance -k 'test_gather$'    # exactly that test
    python -m sdp_jupyter.testing.conformance --world-size 8 -k _group
    python -m sdp_jupyter.testing.conformance --all --budget 3600  # everything, stop after an hour

It runs torch's `torch.testing._internal.distributed.distributed_test` (shipped in the torch
wheel) as pytorch's `test/distributed/test_distributed_spawn.py` does, once per backend (the two
side by side), and prints one table: passes on both, gloo only, smddp only, both fail, skipped.

The suite gates tests by backend *name* at import time (`DistTestCases.backend_feature` and
literal "gloo" checks), so a new backend would be skipped, not tested. This runner opens the gates:
the suite is imported while BACKEND says "gloo" (the decorators then decide as for gloo), smddp is
added to every feature set, and the module's BACKEND is then set to the backend under test. So
smddp runs exactly the tests gloo runs. `monitored_barrier` is reserved for gloo by torch itself.

Each test spawns its ranks afresh (about 10-15 s per test on 2 cores); --budget stops a run in time
and reports what finished.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from sdp_jupyter._env import env_str
from sdp_jupyter.backends import GLOO, SMDDP

BACKENDS = (GLOO, SMDDP)  # the reference first, then ours
_ENV_BACKEND = "SDP_CONFORMANCE_BACKEND"

# The default selection: every CPU test of a collective, of subgroups and of failure handling that
# gloo runs at world size 2, in a few minutes per pattern (names are matched as substrings).
DEFAULT_PATTERNS = (
    "test_all_reduce_sum", "test_all_reduce_max", "test_all_reduce_complex", "test_all_reduce_coalesced_sum",
    "test_broadcast", "test_reduce_sum", "test_all_gather", "test_all_gather_coalesced", "test_gather",
    "test_scatter", "test_send_recv", "test_isend", "test_irecv", "test_batch_isend_irecv_gloo",
    "test_barrier", "test_barrier_timeout", "test_all_to_all", "test_sparse_all_reduce_sum",
    "test_scatter_object_list", "test_gather_object", "test_all_gather_object", "test_broadcast_object_list",
    "test_grads_same_across_ranks_with_no_sync",
)


def _load_suite():
    """Import the suite with the gates opened and return the test class (also in the child ranks:
    torch spawns them with `spawn`, which re-imports this module and rebuilds the same class)."""
    backend = os.environ[_ENV_BACKEND]
    os.environ["BACKEND"] = "gloo"  # import-time decorators decide as they do for gloo
    import torch.testing._internal.common_distributed as common
    from torch.testing._internal.distributed import distributed_test as suite

    import sdp_jupyter.torch  # noqa: F401 - registers smddp in the parent and in every spawned rank

    for features in list(common.DistTestCases.backend_feature.values()):
        if "gloo" in features:
            features.add(backend)
    suite.BACKEND = backend
    os.environ["BACKEND"] = backend

    class TestDistBackendWithSpawn(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

    TestDistBackendWithSpawn.__module__ = __name__
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    return TestDistBackendWithSpawn


if env_str(_ENV_BACKEND):  # the worker and its spawned ranks
    TestDistBackendWithSpawn = _load_suite()


def _status_of(result) -> str:
    if result.failures or result.errors or result.unexpectedSuccesses:
        return "failed"
    return "skipped" if result.skipped else "passed"


def _reason(text: str) -> str:
    """The line that says why: the last exception line of a (child rank's) traceback, else the last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if ("Error" in ln or "Exception" in ln) and ":" in ln
              and "PYTORCH_PRINT_REPRO" not in ln and not ln.startswith("File ")]
    return (errors or lines or [""])[-1][:300]


def _worker(out_path: str, names: list[str]) -> None:
    """Run the named tests of the suite for $SDP_CONFORMANCE_BACKEND; append one JSON line per test."""
    import unittest

    cls = globals()["TestDistBackendWithSpawn"]
    for name in names:
        result = unittest.TestResult()
        test = cls(name)
        start = time.monotonic()
        test.run(result)
        status = _status_of(result)
        detail = ""
        for _, msg in result.failures + result.errors + result.skipped:
            detail = _reason(msg or "")
        with open(out_path, "a") as f:
            f.write(json.dumps({"test": name, "status": status, "detail": detail,
                                "seconds": round(time.monotonic() - start, 1)}) + "\n")


def all_test_names() -> list[str]:
    """Every test of the suite (the names are the same for both backends)."""
    code = ("import os; os.environ.setdefault('%s', 'gloo');"
            "import sdp_jupyter.testing.conformance as c; import unittest;"
            "print('\\n'.join(unittest.TestLoader().getTestCaseNames(c.TestDistBackendWithSpawn)))" % _ENV_BACKEND)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_suite_env("gloo", 2, ""),
                         check=True)
    return out.stdout.split()


# tests for devices and backends this runner does not cover (CPU only; no GPU on the test machines)
EXCLUDE = ("cuda", "nccl", "profiler")


def _matches(name: str, pattern: str) -> bool:
    """Case-insensitive substring; a trailing "$" anchors the end ("test_gather$" is one test)."""
    name, pattern = name.lower(), pattern.lower()
    if pattern.endswith("$"):
        return name.endswith(pattern[:-1])
    return pattern in name


def select(names: list[str], patterns, exclude=EXCLUDE) -> list[str]:
    return [n for n in names if any(_matches(n, p) for p in patterns)
            and not any(x in n.lower() for x in exclude)]


def _suite_env(backend: str, world: int, tmp: str) -> dict:
    """The suite's environment as torch's own runner sets it: no job secret, no RANK (the suite
    passes each rank to init_process_group), a file:// rendezvous."""
    env = {k: v for k, v in os.environ.items() if k not in _JOB_VARIABLES}
    env.update({_ENV_BACKEND: backend, "BACKEND": backend, "WORLD_SIZE": str(world), "TEMP_DIR": tmp or "/tmp",
                "INIT_METHOD": f"file://{tmp or '/tmp'}/init"})
    return env


# What a launcher would have set and torch's runner does not: dropped, so the suite starts its
# ranks exactly as it does for gloo.
_JOB_VARIABLES = ("SDP_JOB_SECRET", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT")


def run_backends(backends, world: int, names: list[str], budget_s: float, log_dir: str) -> dict[str, dict]:
    """Run the tests for each backend in a worker process of its own, side by side (each test spends most
    of its time spawning ranks that import torch, and waiting on them; the runs share nothing: each has its
    own temp folder and file:// rendezvous). A worker still running at the budget, or when this is stopped
    (Ctrl-C), is killed with its ranks (its process group)."""
    code = ("import sys, json, sdp_jupyter.testing.conformance as c;"
            "c._worker(sys.argv[1], json.loads(sys.argv[2]))")
    deadline = time.monotonic() + budget_s
    procs, tmps = {}, []
    try:
        for backend in backends:
            tmps.append(tempfile.mkdtemp(prefix=f"sdp-conf-{backend}-"))
            with open(os.path.join(log_dir, f"{backend}-w{world}.log"), "w") as log:
                procs[backend] = subprocess.Popen(
                    [sys.executable, "-c", code, os.path.join(log_dir, f"{backend}-w{world}.jsonl"), json.dumps(names)],
                    env=_suite_env(backend, world, tmps[-1]), stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True)
        for proc in procs.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for tmp in tmps:
            shutil.rmtree(tmp, ignore_errors=True)
    return {b: _results(os.path.join(log_dir, f"{b}-w{world}.jsonl")) for b in backends}


def _results(out_path: str) -> dict[str, dict]:
    """The JSON lines a worker wrote, by test (the tests it finished before the budget)."""
    results = {}
    if os.path.exists(out_path):
        with open(out_path) as f:
            for line in f:
                d = json.loads(line)
                results[d["test"]] = d
    return results


def table(names, gloo: dict, smddp: dict) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {"passes on both": [], "gloo only": [], "smddp only": [], "both fail": [],
                                  "skipped": [], "not run (budget)": []}
    for n in names:
        g, s = gloo.get(n, {}).get("status"), smddp.get(n, {}).get("status")
        if g is None or s is None:
            rows["not run (budget)"].append(n)
        elif g == "skipped" or s == "skipped":
            rows["skipped"].append(n)
        elif g == s == "passed":
            rows["passes on both"].append(n)
        elif g == "passed":
            rows["gloo only"].append(n)
        elif s == "passed":
            rows["smddp only"].append(n)
        else:
            rows["both fail"].append(n)
    return rows


def render(rows, world: int, smddp: dict, gloo: dict) -> str:
    lines = [f"torch.distributed suite, world size {world}", f"{'outcome':<20} count"]
    lines += [f"{k:<20} {len(v)}" for k, v in rows.items()]
    for k in ("gloo only", "smddp only", "both fail"):
        for n in rows[k]:
            lines.append(f"  {k}: {n}: smddp {smddp[n]['status']} ({smddp[n]['detail'][:160]}) / "
                         f"gloo {gloo[n]['status']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdp_jupyter.testing.conformance", description=__doc__.split("\n\n")[0])
    ap.add_argument("-k", dest="patterns", action="append",
                    help="run tests whose name holds this (repeatable; a trailing $ anchors the end)")
    ap.add_argument("--all", action="store_true", help="every test of the suite (slow: ~10-15 s each per backend)")
    ap.add_argument("--world-size", type=int, default=2, help="ranks per test; the group tests need 8")
    ap.add_argument("--budget", type=float, default=1800.0,
                    help="seconds for the whole run (the backends run side by side); what is left is stopped")
    ap.add_argument("--log-dir", default=None, help="where per-test JSON lines and logs go (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print the table as JSON")
    ap.add_argument("--list", action="store_true", help="only list the selected tests")
    args = ap.parse_args(argv)
    names = all_test_names()
    if not args.all or args.patterns:
        names = select(names, args.patterns or DEFAULT_PATTERNS, () if args.all else EXCLUDE)
    if not names:
        print("no test of the suite matches", args.patterns, file=sys.stderr)
        return 2
    if args.list:
        print("\n".join(names))
        return 0
    log_dir = args.log_dir or tempfile.mkdtemp(prefix="sdp-conformance-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"{len(names)} tests x {BACKENDS}, world size {args.world_size}; logs in {log_dir}", flush=True)
    res = run_backends(BACKENDS, args.world_size, names, args.budget, log_dir)
    rows = table(names, res["gloo"], res["smddp"])
    if args.json:
        print(json.dumps({"world_size": args.world_size, "rows": rows}, indent=1))
    else:
        print(render(rows, args.world_size, res["smddp"], res["gloo"]))
    return 1 if rows["gloo only"] else 0


if __name__ == "__main__":
    sys.exit(main())
