"""The doctor's checks of this machine, one Report line each: platform, Python, torch and the smddp
entry point, numpy, this package, how the engine was built and what it links
(sdp_jupyter._native_check), /dev/shm, cross-process memory reads (process_vm_readv), NVML.

Torch, numpy and pynvml are imported only inside the checks (the GPU machines have no notebook
packages, and the kernel runs the doctor in a subprocess: see report_in_subprocess)."""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from sdp_jupyter.doctor.report import FAIL, INFO, OK, WARN, Report
from sdp_jupyter._env import env_bool

SHM_WARN_BYTES = 1 << 30  # below this, /dev/shm is WARN (Docker's default is 64 MiB)
_MIB = 1 << 20


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
    if v < (3, 11):
        r.add("python", FAIL, what, "sdp_jupyter needs Python 3.11 or newer", brief=f"python {v.major}.{v.minor}")
    else:
        r.add("python", OK, what)


def check_torch(r: Report):
    """The torch line; returns the torch module, or None when it cannot be used."""
    try:
        import torch
        import torch.distributed as dist
    except Exception as e:  # noqa: BLE001 - any import failure is the finding
        r.add("torch", FAIL, f"cannot import torch: {type(e).__name__}: {e}",
              "pip install torch (2.11 or newer; the CPU build is enough for the engine)", brief="torch import")
        return None
    cuda = torch.version.cuda
    built = f"CUDA {cuda}" if cuda else ("ROCm " + torch.version.hip if getattr(torch.version, "hip", None) else "CPU build")
    avail = torch.cuda.is_available()
    what = (f"{torch.__version__} ({built}), cuda available: {'yes' if avail else 'no'}, "
            f"devices: {torch.cuda.device_count() if avail else 0}")
    major_minor = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if major_minor < (2, 11):
        r.add("torch", FAIL, what, "sdp_jupyter needs torch 2.11 or newer: pip install -U torch", brief="torch < 2.11")
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
    try:  # before the engine reads it: its kernel choice refuses a bad value too, and is kept once made
        no_simd = env_bool("SDP_NO_SIMD", False)
    except ValueError as e:  # the engine refuses it the same way when a process group starts
        r.add("engine", FAIL, f"{native.summary()}; {path}", f"{e}; set it to 1 or 0, or unset it",
              brief="SDP_NO_SIMD not a boolean")
        return
    isa = _engine.kernel_isa()
    compiler = _compiler_of(path)
    what = (f"{native.summary()}; kernels {isa}; links {', '.join(native.needed) or 'nothing'}"
            + (f"; built by {compiler}" if compiler else "") + f"; {path}")
    problem = native.problem()
    if problem is not None:
        r.add("engine", FAIL, what, problem, brief="engine exports std:: symbols")
        return
    if isa == "portable" and "avx2" in _cpu_flags() and not no_simd:
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
