"""Per-node system sampler: `python -m sdp_jupyter.monitor.sampler --job-dir DIR --node N [--pids ...]`.

Writes `metrics/system-node-<N>.jsonl` about once a second:
- with NVML (nvidia-ml-py, `import pynvml`): one `kind: "system"` line per GPU, `device: "gpuK"`,
  `source: "nvml"`, utilization, memory used/total, power;
- without it: one line with `device: "cpu"`, `source: "psutil"`: whole-machine CPU utilization and
  memory, and `proc_util` / `proc_rss` of the job's processes on this node. The first line of the
  file (`kind: "sampler"`) says which source is used and why, and stderr says it too, so CPU numbers
  are never read as GPU utilization.

It stops on SIGTERM/SIGINT, when its parent process dies (checked every sample), and when the job's
status.json reaches a final state. The launchers start it through the worker (`python -m
sdp_jupyter.launch.rank.worker --module sdp_jupyter.monitor.sampler ...`, launch/host/ranks.py), which
arms PR_SET_PDEATHSIG (SIGKILL, fired when the *thread* that started it ends) first.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from sdp_jupyter import jobdir


class NvmlSource:
    name = "nvml"

    def __init__(self):
        import pynvml  # nvidia-ml-py

        pynvml.nvmlInit()
        self.nv = pynvml
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        if not self.handles:
            pynvml.nvmlShutdown()
            raise RuntimeError("NVML found no GPU")
        self.note = f"NVML: {len(self.handles)} GPU(s), driver {_text(pynvml.nvmlSystemGetDriverVersion())}"

    def sample(self) -> list[dict]:
        nv = self.nv
        out = []
        for i, h in enumerate(self.handles):
            rec = {"device": f"gpu{i}", "source": "nvml"}
            try:
                rec["util"] = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                mem = nv.nvmlDeviceGetMemoryInfo(h)
                rec["mem_used"], rec["mem_total"] = int(mem.used), int(mem.total)
            except nv.NVMLError as exc:  # a GPU that fell off the bus is reported, not fatal
                rec["error"] = str(exc)
            try:
                rec["power_w"] = nv.nvmlDeviceGetPowerUsage(h) / 1000.0
            except nv.NVMLError:
                pass
            out.append(rec)
        return out

    def close(self):
        try:
            self.nv.nvmlShutdown()
        except Exception:
            pass


def _text(v):
    return v.decode() if isinstance(v, bytes) else str(v)


class PsutilSource:
    """CPU fallback. `util` is whole-machine CPU percent; `proc_util` sums the job's processes
    (percent of one core, so up to 100 * ncpu)."""

    name = "psutil"

    def __init__(self, job_dir: str, node: int, pids: list[int] | None, reason: str):
        import psutil

        self.psutil = psutil
        self.job_dir = os.path.realpath(job_dir)
        self.node = node
        self.fixed_pids = pids
        self.procs: dict[int, object] = {}
        self._next_scan = 0.0
        self.ncpu = psutil.cpu_count() or 1
        psutil.cpu_percent(interval=None)  # prime: the first call returns 0.0
        self.note = f"no GPU telemetry ({reason}); sampling CPU with psutil: utilization is CPU, not GPU"

    def _job_pids(self) -> list[int]:
        if self.fixed_pids is not None:
            return self.fixed_pids
        now = time.monotonic()
        if now < self._next_scan:
            return list(self.procs)
        self._next_scan = now + (5.0 if self.procs else 0.0)  # workers may start after the sampler
        found = []
        me = os.getpid()
        for p in self.psutil.process_iter():
            if p.pid == me:  # the sampler may carry the job's environment itself
                continue
            try:
                env = p.environ()
            except (self.psutil.Error, OSError):
                continue
            d = env.get("SDP_JOB_DIR")
            if d and os.path.realpath(d) == self.job_dir and env.get("GROUP_RANK", "0") == str(self.node):
                found.append(p.pid)
        return found + [p for p in self._warm_pids() if p not in found]

    def _warm_pids(self) -> list[int]:
        """This node's ranks from status.json when they were forked by the warm pool: a forked rank's
        /proc environ is the pool's, so the scan above cannot see it (docs/warm.md)."""
        try:
            with open(os.path.join(self.job_dir, jobdir.STATUS)) as f:
                status = json.load(f)
            if status.get("start") != "warm":
                return []
            with open(os.path.join(self.job_dir, jobdir.SPEC)) as f:
                ppn = max(1, int(json.load(f).get("procs_per_node") or 1))
            pids = status.get("pids") or []
            return [int(p) for i, p in enumerate(pids) if i // ppn == self.node and self.psutil.pid_exists(int(p))]
        except (OSError, ValueError, TypeError):
            return []

    def sample(self) -> list[dict]:
        ps = self.psutil
        roots = self._job_pids()
        live: dict[int, object] = {}
        for pid in roots:
            try:
                p = self.procs.get(pid) or ps.Process(pid)
                live[pid] = p
                for c in p.children(recursive=True):  # DataLoader workers count too
                    live[c.pid] = self.procs.get(c.pid) or c
            except ps.Error:
                continue
        proc_util = 0.0
        proc_rss = 0
        for pid, p in list(live.items()):
            try:
                with p.oneshot():
                    util = p.cpu_percent(interval=None)  # a new process's first call primes it (0.0)
                    if pid in self.procs:
                        proc_util += util
                    proc_rss += p.memory_info().rss
            except ps.Error:
                live.pop(pid, None)
        self.procs = live
        vm = ps.virtual_memory()
        return [{
            "device": "cpu", "source": "psutil", "util": ps.cpu_percent(interval=None),
            "mem_used": int(vm.total - vm.available), "mem_total": int(vm.total),
            "proc_util": proc_util, "proc_rss": proc_rss, "nproc": len(live), "ncpu": self.ncpu,
        }]

    def close(self):
        pass


def open_source(job_dir: str, node: int, pids: list[int] | None, force_cpu: bool = False):
    if not force_cpu:
        try:
            return NvmlSource()
        except Exception as exc:  # NVMLError_LibraryNotFound on a machine without a driver
            reason = f"NVML unavailable: {type(exc).__name__}: {exc}"
    else:
        reason = "CPU sampling requested"
    return PsutilSource(job_dir, node, pids, reason)


def _job_finished(status_path: str) -> bool:
    try:
        with open(status_path, encoding="utf-8") as f:
            return json.load(f).get("state") in jobdir.FINAL_STATES
    except (OSError, ValueError, AttributeError):
        return False


def run(job_dir: str, node: int, pids: list[int] | None = None, interval: float = 1.0,
        force_cpu: bool = False, stop: threading.Event | None = None) -> None:
    stop = stop or threading.Event()
    parent = os.getppid()
    path = jobdir.node_metrics_path(job_dir, node)
    os.makedirs(path.parent, mode=0o700, exist_ok=True)
    status_path = os.path.join(job_dir, jobdir.STATUS)
    source = open_source(job_dir, node, pids, force_cpu)
    print(f"[sdp sampler node {node}] {source.note}", file=sys.stderr, flush=True)
    with jobdir.open_private(path, "a", encoding="utf-8") as out:  # 0600, never through a link
        out.write(json.dumps({"t": time.time(), "kind": "sampler", "node": node, "source": source.name,
                              "pid": os.getpid(), "interval": interval, "note": source.note}) + "\n")
        out.flush()
        next_t = time.monotonic()
        if source.name == "psutil":  # CPU percentages need one interval after priming
            next_t += interval
            stop.wait(interval)
        try:
            while not stop.is_set():
                t = time.time()
                for rec in source.sample():
                    out.write(json.dumps({"t": t, "kind": "system", "node": node, **rec}) + "\n")
                out.flush()
                if os.getppid() != parent or _job_finished(status_path):
                    break
                next_t += interval
                stop.wait(max(0.0, next_t - time.monotonic()))
        finally:
            source.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sdp_jupyter.monitor.sampler", description=__doc__.split("\n\n")[0])
    ap.add_argument("--job-dir", required=True,
                    help="the job's directory: samples go to its metrics/system-node-N.jsonl, and the sampler "
                         "stops when its status.json reaches a final state")
    ap.add_argument("--node", type=int, default=0, help="this node's index in the job (default 0)")
    ap.add_argument("--pids", type=int, nargs="*", default=None,
                    help="worker pids on this node (default: found by their SDP_JOB_DIR and GROUP_RANK)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between samples (default 1.0)")
    ap.add_argument("--cpu", action="store_true", help="skip NVML and sample CPU")
    args = ap.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    run(args.job_dir, args.node, args.pids, args.interval, args.cpu, stop)
    return 0


if __name__ == "__main__":
    sys.exit(main())
