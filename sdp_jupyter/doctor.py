"""`python -m sdp_jupyter.doctor`: will it work on this machine? (also `%sdp_doctor` in a notebook)

A report to paste into a bug report, in the spirit of DeepSpeed's `ds_report` and `accelerate env`:
one line per check, each OK, WARN, FAIL or INFO, and for anything not OK the fix in words. It checks
the platform, Python, torch, numpy, this package, how the engine was built and what it links
(sdp_jupyter._native_check), /dev/shm, cross-process memory reads, NVML, and runs a 2-rank
all_reduce through smddp against gloo in two fresh processes (and on CUDA tensors when torch sees a
GPU), so that a hang or a crash becomes a FAIL line instead of a hung cell.

    python -m sdp_jupyter.doctor [--json] [--no-smoke]      exit status 1 when any line is FAIL

Imports no notebook package (the GPU machines have none) and torch only inside the checks.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from sdp_jupyter.launch.process import PACKAGE_PARENT, free_port

OK, WARN, FAIL, INFO = "OK", "WARN", "FAIL", "INFO"
STATUSES = (OK, WARN, FAIL, INFO)

SHM_WARN_BYTES = 1 << 30  # below this, /dev/shm is WARN (Docker's default is 64 MiB)
SMOKE_TIMEOUT_S = 60.0
_MIB = 1 << 20


@dataclass
class Check:
    name: str  # what was checked ("/dev/shm")
    status: str  # OK / WARN / FAIL / INFO
    detail: str  # what was found
    fix: str = ""  # for anything not OK: what to do, in words
    brief: str = ""  # a few words for summary_line ("/dev/shm 64 MiB"); default: name

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")


@dataclass
class Report:
    checks: list[Check] = field(default_factory=list)

    def add(self, name: str, status: str, detail: str, fix: str = "", brief: str = "") -> Check:
        check = Check(name, status, detail, fix, brief)
        self.checks.append(check)
        return check

    def counts(self) -> dict[str, int]:
        return {s: sum(c.status == s for c in self.checks) for s in STATUSES}

    @property
    def failed(self) -> bool:
        return any(c.status == FAIL for c in self.checks)

    def to_dict(self) -> dict:
        return {"checks": [dataclasses.asdict(c) for c in self.checks], "counts": self.counts(),
                "failed": self.failed, "summary": summary_line(self)}

    @classmethod
    def from_dict(cls, data: dict) -> "Report":
        return cls([Check(**c) for c in data["checks"]])

    def text(self) -> str:
        width = max((len(c.name) for c in self.checks), default=0)
        out = ["sdp_jupyter doctor: paste this into a bug report"]
        for c in self.checks:
            out.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
            if c.fix and c.status != OK:
                out.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
        out.append(summary_line(self))
        return "\n".join(out)


def summary_line(report: Report) -> str:
    """One line: "doctor: 9 OK, 1 WARN (/dev/shm 64 MiB), 0 FAIL" (and the INFO count when any)."""
    def part(status):
        items = [c.brief or c.name for c in report.checks if c.status == status]
        n = report.counts()[status]
        return f"{n} {status}" + (f" ({'; '.join(items)})" if items and status in (WARN, FAIL) else "")

    line = f"doctor: {part(OK)}, {part(WARN)}, {part(FAIL)}"
    return line + (f", {part(INFO)}" if report.counts()[INFO] else "")


# ---------------------------------------------------------------------------------------- checks
def _mib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n // _MIB} MiB"


def check_platform(r: Report) -> None:
    system, machine = platform.system(), platform.machine()
    libc = " ".join(platform.libc_ver()).strip()
    what = f"{system} {machine}" + (f" ({libc})" if libc else "") + f", kernel {platform.release()}"
    if system != "Linux":
        r.add("platform", FAIL, what, "the engine needs Linux (epoll, shared memory in /dev/shm, process_vm_readv): "
              "run on a Linux machine or in a Linux container", brief=f"platform {system}")
    elif machine not in ("x86_64", "amd64", "AMD64"):
        r.add("platform", WARN, what, f"Linux x86-64 is what is tested; on {machine} the engine builds its portable "
              "kernels and is untested: report what fails", brief=f"platform {machine}")
    else:
        r.add("platform", OK, what)


def check_python(r: Report) -> None:
    v = sys.version_info
    what = f"{platform.python_version()} ({sys.executable})"
    if v < (3, 10):
        r.add("python", FAIL, what, "sdp_jupyter needs Python 3.10 or newer", brief=f"python {v.major}.{v.minor}")
    else:
        r.add("python", OK, what)


def check_torch(r: Report):
    """The torch line; returns the torch module, or None when it cannot be used."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        r.add("torch", FAIL, f"cannot import torch: {type(e).__name__}: {e}",
              "pip install torch (2.4 or newer; the CPU build is enough for the engine)", brief="torch import")
        return None
    cuda = torch.version.cuda
    built = f"CUDA {cuda}" if cuda else ("ROCm " + torch.version.hip if getattr(torch.version, "hip", None) else "CPU build")
    avail = torch.cuda.is_available()
    what = (f"{torch.__version__} ({built}), cuda available: {'yes' if avail else 'no'}, "
            f"devices: {torch.cuda.device_count() if avail else 0}")
    major_minor = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if major_minor < (2, 4):
        r.add("torch", FAIL, what, "sdp_jupyter needs torch 2.4 or newer: pip install -U torch", brief="torch < 2.4")
        return None
    if not dist.is_available():
        r.add("torch", FAIL, what, "this torch build has no torch.distributed: install a build that has it "
              "(the wheels from pypi.org and download.pytorch.org do)", brief="no torch.distributed")
        return None
    if cuda and not avail:
        r.add("torch", INFO, what, "torch was built with CUDA but sees no GPU (no driver, or CUDA_VISIBLE_DEVICES "
              "hides them): CPU tensors only")
    else:
        r.add("torch", OK, what)
    return torch


def check_backend_registration(r: Report) -> None:
    """Is "smddp" known at `import torch` (the entry point) without `import sdp_jupyter.torch`?"""
    from importlib.metadata import entry_points

    eps = [ep for ep in entry_points(group="torch.backends") if ep.name == "smddp"]
    autoload = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1").strip()
    if not eps:
        r.add("smddp backend", WARN, "no torch.backends entry point named smddp: `import torch` does not register it",
              "reinstall the package (pip install -e .), or `import sdp_jupyter.torch` before "
              "init_process_group(\"smddp\")", brief="smddp entry point missing")
    elif autoload == "0":
        r.add("smddp backend", WARN, f"entry point {eps[0].value}, but TORCH_DEVICE_BACKEND_AUTOLOAD=0 turns it off",
              "unset TORCH_DEVICE_BACKEND_AUTOLOAD, or `import sdp_jupyter.torch` before init_process_group(\"smddp\")",
              brief="backend autoload off")
    else:
        r.add("smddp backend", OK, f"registered at `import torch` (entry point {eps[0].value})")


def check_numpy(r: Report) -> None:
    try:
        import numpy
    except Exception as e:  # noqa: BLE001
        r.add("numpy", FAIL, f"cannot import numpy: {type(e).__name__}: {e}",
              "pip install numpy (sdp_jupyter.comm, the engine's Python face, needs it)", brief="numpy")
        return
    r.add("numpy", OK, numpy.__version__)


def check_package(r: Report) -> None:
    import sdp_jupyter

    where = str(Path(sdp_jupyter.__file__).resolve().parent)
    from importlib.metadata import distributions

    # a checkout's sdp_jupyter.egg-info may sit beside the installed dist-info: pip's record says "editable"
    dists = list(distributions(name="sdp_jupyter"))
    how = ", not installed (imported from the path)" if not dists else ", installed"
    for d in dists:
        direct = json.loads(d.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            how = f", editable install of {direct.get('url', '?').removeprefix('file://')}"
            break
    versions = sorted({d.version for d in dists} - {sdp_jupyter.__version__})
    if versions:
        r.add("sdp_jupyter", WARN, f"{sdp_jupyter.__version__} at {where}, but installed metadata says "
              f"{', '.join(versions)}", "reinstall (pip install -e . in the checkout) so the two agree",
              brief="sdp_jupyter version mismatch")
        return
    r.add("sdp_jupyter", OK, f"{sdp_jupyter.__version__} at {where}{how}")


_BUILD_FIX = ("a C++17 compiler (g++ or clang++) and the Python headers (python3-dev), then `pip install -e .` "
              "in the checkout (it compiles native/)")


def _compiler_of(path: str) -> str:
    """The compiler named in the object's .comment section (e.g. 'GCC: (Debian 12.2.0-14) 12.2.0')."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return ""
    found = re.findall(rb"GCC: \([^)\n]*\) [\w.\-]+|clang version [\w.\-]+", data)
    names = list(dict.fromkeys(f.decode("ascii", "replace") for f in found))
    return "; ".join(names[:2])


def check_engine(r: Report) -> None:
    from sdp_jupyter import _native_check

    try:
        from sdp_jupyter import _engine
    except Exception as e:  # noqa: BLE001 - ImportError, or an OSError from the loader
        r.add("engine", FAIL, f"cannot import sdp_jupyter._engine: {type(e).__name__}: {e}", _BUILD_FIX,
              brief="engine not importable")
        return
    path = _native_check.engine_path()
    try:
        native = _native_check.inspect(path)
    except (OSError, ValueError) as e:
        r.add("engine", WARN, f"{path}: cannot read its ELF file ({e})", "rebuild it: " + _BUILD_FIX,
              brief="engine unreadable")
        return
    isa = _engine.kernel_isa()
    compiler = _compiler_of(path)
    what = (f"{native.summary()}; kernels {isa}; links {', '.join(native.needed) or 'nothing'}"
            + (f"; built by {compiler}" if compiler else "") + f"; {path}")
    problem = native.problem()
    if problem is not None:
        r.add("engine", FAIL, what, problem, brief="engine exports std:: symbols")
        return
    if isa == "portable" and "avx2" in _cpu_flags() and os.environ.get("SDP_NO_SIMD", "").strip().lower() in ("", "0", "false", "no", "off"):
        r.add("engine", WARN, what, "the CPU has AVX2 but the engine runs its portable kernels (slower reductions): "
              "it was built with SDP_PORTABLE=1; rebuild without it (pip install -e .)", brief="engine portable kernels")
        return
    r.add("engine", OK, what)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def check_shm(r: Report, path: str = "/dev/shm") -> None:
    if not os.path.isdir(path):
        r.add("/dev/shm", FAIL, f"{path} does not exist",
              "the ranks of one node meet in shared memory there: mount a tmpfs on /dev/shm "
              "(mount -t tmpfs -o size=8g tmpfs /dev/shm)", brief="/dev/shm missing")
        return
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix="sdp-doctor-"):
            pass
    except OSError as e:
        r.add("/dev/shm", FAIL, f"{path} is not writable ({e.strerror})",
              f"the ranks of one node meet in shared memory there: make {path} writable for this user "
              "(it is normally a world-writable tmpfs with the sticky bit, mode 1777)", brief="/dev/shm not writable")
        return
    st = os.statvfs(path)
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    what = f"writable, {_mib(free)} free of {_mib(total)}"
    if free < SHM_WARN_BYTES:
        r.add("/dev/shm", WARN, what,
              "the ranks of one node meet there (each process group maps (ranks + 1) x SDP_CHUNK_BYTES, 4 MiB by "
              "default) and torch DataLoader workers pass batches through it. In Docker the default is 64 MiB: "
              "docker run --shm-size=8g (or --ipc=host); on Kubernetes mount an emptyDir with medium: Memory on "
              "/dev/shm; else remount it larger (mount -o remount,size=8g /dev/shm)", brief=f"/dev/shm {_mib(free)}")
    else:
        r.add("/dev/shm", OK, what)


_PROBE = r"""
import ctypes, sys
pid, addr, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
buf = ctypes.create_string_buffer(n)
libc = ctypes.CDLL(None, use_errno=True)
libc.process_vm_readv.restype = ctypes.c_ssize_t
got = libc.process_vm_readv(pid, ctypes.byref(iovec(ctypes.cast(buf, ctypes.c_void_p), n)), 1,
                            ctypes.byref(iovec(addr, n)), 1, 0)
if got != n:
    import os
    print(os.strerror(ctypes.get_errno()) if got < 0 else f"read {got} of {n} bytes", end="")
    sys.exit(1)
sys.stdout.write(buf.raw.hex())
"""


def _probe_peer_read() -> tuple[bool, str]:
    """A child process reads a nonce from this process's memory with process_vm_readv: what one rank
    does to another of its node (they are not each other's descendants, nor is the child ours')."""
    import ctypes
    import secrets

    nonce = secrets.token_bytes(16)
    buf = ctypes.create_string_buffer(nonce, len(nonce))
    try:
        p = subprocess.run([sys.executable, "-c", _PROBE, str(os.getpid()), str(ctypes.addressof(buf)), str(len(nonce))],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, str(e)
    if p.returncode == 0:
        return (True, "") if p.stdout == nonce.hex() else (False, "it read other bytes than the nonce")
    return False, p.stdout.strip() or (p.stderr.strip().splitlines() or ["no output"])[-1]


def check_peer_reads(r: Report, scope_path: str = "/proc/sys/kernel/yama/ptrace_scope") -> None:
    try:
        scope = int(Path(scope_path).read_text().strip())
        yama = f"Yama ptrace_scope {scope}"
    except (OSError, ValueError):
        scope, yama = None, "no Yama ptrace_scope"
    ok, why = _probe_peer_read()
    fallback = ("the engine probes this at the first large (> 64 KiB) gather, scatter or all_to_all and, refused, "
                "sends those between ranks of one node through the shared-memory slots (two copies instead of one); "
                "all_reduce, broadcast and the other collectives never read peers' memory")
    if ok:
        r.add("peer memory reads", OK, f"{yama}: process_vm_readv between processes works (the single-copy path "
              "of large gather, scatter and all_to_all within a node)")
        return
    what = f"{yama}: process_vm_readv of another process refused ({why}); {fallback}"
    if scope == 1:
        r.add("peer memory reads", INFO, what,
              "for the single-copy path: sudo sysctl -w kernel.yama.ptrace_scope=0, or give the ranks CAP_SYS_PTRACE "
              "(docker run --cap-add SYS_PTRACE); nothing to do otherwise (SDP_NO_CMA=1 skips the probe)")
    elif scope in (2, 3):
        fix = ("ptrace_scope 3 cannot be lowered until a reboot; " if scope == 3 else
               "only processes with CAP_SYS_PTRACE may read others' memory (--cap-add SYS_PTRACE), or an "
               "administrator lowers it: sudo sysctl -w kernel.yama.ptrace_scope=0; ")
        r.add("peer memory reads", WARN, what, fix + "large gather, scatter and all_to_all within a node take the "
              "slower path meanwhile (SDP_NO_CMA=1 skips the probe)", brief=f"ptrace_scope {scope}")
    else:
        r.add("peer memory reads", WARN, what,
              "a seccomp filter (container runtimes) or separate PID namespaces block it: in Docker --cap-add "
              "SYS_PTRACE or a seccomp profile that allows process_vm_readv; ranks of one node must share a PID "
              "namespace (SDP_NO_CMA=1 skips the probe)", brief="peer memory reads refused")


def check_nvml(r: Report, torch_cuda: bool) -> None:
    try:
        import pynvml
    except Exception:  # noqa: BLE001
        r.add("NVML", WARN if torch_cuda else INFO, "nvidia-ml-py is not installed",
              "pip install nvidia-ml-py (the dashboard reads GPU utilization through it)", brief="nvidia-ml-py missing")
        return
    try:
        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...
        if torch_cuda:
            r.add("NVML", WARN, f"nvmlInit failed ({type(e).__name__}: {e}) although torch sees a GPU",
                  "the dashboard falls back to CPU utilization: make libnvidia-ml.so.1 loadable (the driver's "
                  "library; in containers the NVIDIA container toolkit mounts it)", brief="NVML")
        else:
            r.add("NVML", INFO, "no NVIDIA driver: the dashboard shows CPU utilization, labelled as such")
        return
    try:
        def text(v):
            return v.decode() if isinstance(v, bytes) else str(v)

        driver = text(pynvml.nvmlSystemGetDriverVersion())
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(f"{i}: {text(pynvml.nvmlDeviceGetName(h))} {_mib(pynvml.nvmlDeviceGetMemoryInfo(h).total)}")
        r.add("NVML", OK, f"driver {driver}, {len(gpus)} GPU(s): " + ("; ".join(gpus) or "none"))
    except Exception as e:  # noqa: BLE001
        r.add("NVML", WARN, f"NVML answered nvmlInit but then failed: {type(e).__name__}: {e}",
              "check the driver (nvidia-smi); the dashboard may show CPU utilization instead", brief="NVML")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


# ---------------------------------------------------------------------------------------- smoke
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


def _signal_name(code: int) -> str:
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))  # this very sdp_jupyter
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
        sigs = ", ".join(f"rank {rank} killed by {_signal_name(c)}" for rank, c in crashed)
        segv = any(c == -signal.SIGSEGV for _, c in crashed)
        fix = ("a SIGSEGV here is the classic sign of two C++ runtimes in one process (an engine with its own "
               "statically linked libstdc++ beside torch's): see the engine line, rebuild with the distribution's g++ "
               "(CC=gcc CXX=g++ pip install -e .); the faulthandler stack is in the log" if segv else
               "read the ranks' output (the faulthandler stack is there) and report it")
        return Check(name, FAIL, f"{sigs}; {where}", fix, brief=f"smoke {device} {_signal_name(crashed[0][1])}")
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


# ---------------------------------------------------------------------------------------- the report
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
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PACKAGE_PARENT, env.get("PYTHONPATH")]))
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Report([Check("doctor", FAIL, f"{' '.join(argv[1:])} did not finish within {timeout:g} s",
                             "run it in a terminal to see where it stops", brief="doctor hung")])
    try:
        return Report.from_dict(json.loads(p.stdout))
    except (ValueError, KeyError, TypeError):
        why = f"killed by {_signal_name(p.returncode)}" if p.returncode < 0 else f"exit status {p.returncode}"
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


if __name__ == "__main__":
    sys.exit(main())
