"""The doctor's smoke run: a 2-rank all_reduce through smddp, checked against gloo on the same
inputs, in two fresh processes (and on CUDA tensors when torch sees a GPU), so that a hang or a crash
becomes a FAIL line instead of a hung cell."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sdp_jupyter.doctor.report import FAIL, OK, Check
from sdp_jupyter._net import free_port
from sdp_jupyter.launch.process import rank_pythonpath

SMOKE_TIMEOUT_S = 60.0


_SMOKE = r"""
# sdp_jupyter doctor: a 2-rank all_reduce through smddp, checked against gloo on the same inputs
import datetime, faulthandler, json, os, sys
faulthandler.enable()
rank, world, port, device, wait = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], float(sys.argv[5])
import torch
import torch.distributed as dist
import sdp_jupyter.torch  # registers smddp even where the entry point is off
if device == "cuda":
    torch.cuda.set_device(0)  # both ranks may share GPU 0
timeout = datetime.timedelta(seconds=wait)
dist.init_process_group("smddp", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timeout)
gloo = dist.new_group(backend="gloo", timeout=timeout)
print(f"rank {rank}: process group up ({dist.get_backend()}) with gloo beside it", flush=True)
bad = []
cases = [(torch.float32, 1024), (torch.float32, 1 << 20), (torch.float64, 4099), (torch.int32, 1 << 16),
         (torch.int64, 37), (torch.bfloat16, 1 << 12)]
ops = [dist.ReduceOp.SUM, dist.ReduceOp.MAX]
for dtype, n in cases:
    for op in ops:
        g = torch.Generator().manual_seed(1000 * rank + n)
        x = torch.randint(-1000, 1000, (n,), generator=g).to(dtype)  # integers: exact in every dtype here
        a, b = x.clone().to(device), x.clone().to(device)
        dist.all_reduce(a, op=op)
        dist.all_reduce(b, op=op, group=gloo)
        if not torch.equal(a.cpu(), b.cpu()):
            bad.append(f"{dtype} x {n} {op}: {(a.cpu() != b.cpu()).sum().item()} elements differ from gloo's")
if device == "cuda":
    torch.cuda.synchronize()
dist.barrier()
print(f"rank {rank}: " + json.dumps({"cases": len(cases) * len(ops), "bad": bad}), flush=True)
dist.destroy_process_group()
sys.exit(3 if bad else 0)
"""


def signal_name(code: int) -> str:
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


def run_smoke(device: str = "cpu", timeout: float = SMOKE_TIMEOUT_S) -> Check:
    """Two fresh processes all_reduce through smddp and through gloo; a hang, crash or difference is FAIL."""
    name = f"smoke all_reduce ({device})"
    out = Path(tempfile.mkdtemp(prefix=f"sdp-doctor-{device}-"))
    script = out / "smoke.py"
    script.write_text(_SMOKE)
    env = dict(os.environ)
    env["PYTHONPATH"] = rank_pythonpath(env.get("PYTHONPATH"), compat=False)  # this very sdp_jupyter
    env["PYTHONFAULTHANDLER"] = "1"
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # the doctor's own job variables (if run inside a job) must not leak in
    port = free_port()
    started = time.monotonic()
    procs, logs = [], []
    try:
        for rank in range(2):
            log = open(out / f"rank{rank}.log", "wb")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, str(script), str(rank), "2", str(port), device,
                                           str(max(5.0, timeout - 15))],
                                          stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env=env, cwd=out, start_new_session=True))
        deadline = started + timeout
        hung = []
        for rank, p in enumerate(procs):
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung.append(rank)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
        for log in logs:
            log.close()
    took = time.monotonic() - started
    where = f"output in {out}/rank0.log and rank1.log"
    if hung:
        return Check(name, FAIL, f"rank(s) {', '.join(map(str, hung))} did not finish within {timeout:g} s "
                     f"(killed); {where}", "read the ranks' output; a hang in init_process_group often means the "
                     "loopback interface or 127.0.0.1 is blocked; report it with this output", brief=f"smoke {device} hang")
    codes = [p.returncode for p in procs]
    crashed = [(rank, c) for rank, c in enumerate(codes) if c < 0]
    if crashed:
        sigs = ", ".join(f"rank {rank} killed by {signal_name(c)}" for rank, c in crashed)
        segv = any(c == -signal.SIGSEGV for _, c in crashed)
        fix = ("a SIGSEGV here is the classic sign of two C++ runtimes in one process (an engine with its own "
               "statically linked libstdc++ beside torch's): see the engine line, rebuild with the distribution's g++ "
               "(CC=gcc CXX=g++ pip install -e .); the faulthandler stack is in the log" if segv else
               "read the ranks' output (the faulthandler stack is there) and report it")
        return Check(name, FAIL, f"{sigs}; {where}", fix, brief=f"smoke {device} {signal_name(crashed[0][1])}")
    if any(codes):
        text = (out / "rank0.log").read_text(errors="replace") + (out / "rank1.log").read_text(errors="replace")
        differ = [ln for ln in text.splitlines() if '"bad": [' in ln and '"bad": []' not in ln]
        if differ:
            return Check(name, FAIL, f"smddp's results differ from gloo's: {differ[0]}; {where}",
                         "report it with the ranks' output: this is an engine bug", brief=f"smoke {device} wrong")
        last = next((ln for ln in reversed(text.splitlines()) if ln.strip()), "no output")
        return Check(name, FAIL, f"exit codes {codes}: {last[:300]}; {where}",
                     "read the ranks' output; the last line usually names the cause and its fix",
                     brief=f"smoke {device} failed")
    said = re.search(r'"cases": (\d+)', (out / "rank0.log").read_text(errors="replace"))
    for log in ("rank0.log", "rank1.log", "smoke.py"):
        (out / log).unlink(missing_ok=True)
    out.rmdir()
    return Check(name, OK, f"2 ranks, {said.group(1) if said else '?'} all_reduces (fp32, fp64, bf16, int32, int64; "
                 f"SUM and MAX; up to 4 MiB) equal to gloo's, {took:.1f} s with process start")
