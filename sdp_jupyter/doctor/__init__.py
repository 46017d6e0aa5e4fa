"""`python -m sdp_jupyter.doctor`: will it work on this machine? (also `%sdp_doctor` in a notebook)

A report to paste into a bug report, in the spirit of DeepSpeed's `ds_report` and `accelerate env`:
one line per check, each OK, WARN, FAIL or INFO, and for anything not OK the fix in words. It checks
the platform, Python, torch, numpy, this package, how the engine was built and what it links
(sdp_jupyter._native_check), /dev/shm, cross-process memory reads, NVML, and runs a 2-rank
all_reduce through smddp against gloo in two fresh processes (and on CUDA tensors when torch sees a
GPU), so that a hang or a crash becomes a FAIL line instead of a hung cell.

    python -m sdp_jupyter.doctor [--json] [--no-smoke]      exit status 1 when any line is FAIL

Imports no notebook package (the GPU machines have none) and torch only inside the checks.

The package: report (Check, Report, summary_line), checks (one function per line of the report),
smoke (the 2-rank all_reduce runs) and, here, collect (all of them in order), report_in_subprocess
(what %sdp_doctor and the main job use) and main (the command line; __main__.py runs it).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from sdp_jupyter.doctor.checks import (SHM_WARN_BYTES, check_backend_registration, check_engine, check_numpy,
                                       check_nvml, check_package, check_peer_reads, check_platform, check_python,
                                       check_shm, check_torch)
from sdp_jupyter.doctor.report import FAIL, INFO, OK, STATUSES, WARN, Check, Report, summary_line
from sdp_jupyter.doctor.smoke import SMOKE_TIMEOUT_S, run_smoke, signal_name
from sdp_jupyter.launch.process import rank_pythonpath

__all__ = ["FAIL", "INFO", "OK", "SHM_WARN_BYTES", "SMOKE_TIMEOUT_S", "STATUSES", "WARN", "Check", "Report",
           "check_backend_registration", "check_engine", "check_numpy", "check_nvml", "check_package",
           "check_peer_reads", "check_platform", "check_python", "check_shm", "check_torch", "collect", "main",
           "report_in_subprocess", "run_smoke", "summary_line"]


def collect(smoke: bool = True, smoke_timeout: float = SMOKE_TIMEOUT_S) -> Report:
    r = Report()
    check_platform(r)
    check_python(r)
    torch = check_torch(r)
    if torch is not None:
        check_backend_registration(r)
    check_numpy(r)
    check_package(r)
    check_engine(r)
    check_shm(r)
    check_peer_reads(r)
    cuda = bool(torch is not None and torch.cuda.is_available())
    check_nvml(r, cuda)
    engine_ok = all(c.status != FAIL for c in r.checks if c.name == "engine")
    if not smoke:
        r.add("smoke all_reduce", INFO, "skipped (--no-smoke)")
    elif torch is None or not engine_ok:
        r.add("smoke all_reduce", INFO, "not run: torch or the engine failed above (fix those first)")
    else:
        r.checks.append(run_smoke("cpu", smoke_timeout))
        if cuda:
            r.checks.append(run_smoke("cuda", smoke_timeout))
    return r


def report_in_subprocess(smoke: bool = True, timeout: float = 3 * SMOKE_TIMEOUT_S) -> Report:
    """The report, collected by `python -m sdp_jupyter.doctor --json` in a fresh process: what the magic
    and the main job use, so that the kernel never imports torch and a stuck doctor costs `timeout`."""
    argv = [sys.executable, "-m", "sdp_jupyter.doctor", "--json"] + ([] if smoke else ["--no-smoke"])
    env = dict(os.environ)
    env["PYTHONPATH"] = rank_pythonpath(env.get("PYTHONPATH"), compat=False)
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Report([Check("doctor", FAIL, f"{' '.join(argv[1:])} did not finish within {timeout:g} s",
                             "run it in a terminal to see where it stops", brief="doctor hung")])
    try:
        return Report.from_dict(json.loads(p.stdout))
    except (ValueError, KeyError, TypeError):
        why = f"killed by {signal_name(p.returncode)}" if p.returncode < 0 else f"exit status {p.returncode}"
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:300]
        return Report([Check("doctor", FAIL, f"{' '.join(argv[1:])} gave no report ({why}): {tail}",
                             "run it in a terminal to see the whole error", brief="doctor failed")])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdp_jupyter.doctor",
                                 description="Will sdp_jupyter work on this machine? A report to paste into a bug report.")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument("--no-smoke", action="store_true", help="skip the 2-rank all_reduce runs (a few seconds each)")
    ap.add_argument("--smoke-timeout", type=float, default=SMOKE_TIMEOUT_S, metavar="S",
                    help=f"seconds a smoke run may take before it is killed and reported (default {SMOKE_TIMEOUT_S:g})")
    args = ap.parse_args(argv)
    report = collect(smoke=not args.no_smoke, smoke_timeout=args.smoke_timeout)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.text(), flush=True)
    return 1 if report.failed else 0

