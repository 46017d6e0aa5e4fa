"""A user who installs sdp_jupyter from a wheel into an environment of their own, with no dev.sh and no
checkout on the path, can run the doctor, a 2-node job and a SageMaker rehearsal with our engine.

What the test does, once per module (about two minutes, most of it compiling the engine; the rehearsal
compiles it once more):

1. The wheel: the checkout's files (tracked, and untracked ones git does not ignore, as a clone with
   the work in progress would have them; never build/, .venv/ or an engine built earlier) are copied to
   a temporary folder and built there with `python -m build --outdir DIR`, as install.md tells users:
   an sdist, then the wheel built from that sdist (so the sdist is checked to carry native/ and build).
   Two departures from a user's build, both for speed and to need no network: `--no-isolation
   --skip-dependency-check` (setuptools and pybind11 come from the running environment instead of being
   downloaded into a fresh build environment; setuptools has bdist_wheel, so `wheel` may be absent) and
   SDP_BUILD_QUICK=1 (the engine at -O0: it builds in a third of the time; the code is the same).
2. The user's environment, with torch "already there": `python -m venv --without-pip NEW`, then this
   environment's pip installs the wheel into it (`pip --python NEW/bin/python install --no-deps
   --no-index WHEEL`: NEW is still empty, so pip sees no other sdp_jupyter). Only then NEW is given the
   packages a user would already have (torch, numpy and the wheel's other dependencies): a link in
   NEW's site-packages to every entry of this environment's site-packages except sdp_jupyter's own
   (its editable install and metadata), .pth files included. In NEW's own site folder, as a user's
   torch is, they are what site.getsitepackages() lists (a rehearsal's "image" links what that lists).
   Copying torch (GiBs) or downloading it would take minutes; links take milliseconds, and NEW can
   import sdp_jupyter only from the wheel.
3. From a working folder outside the checkout, with PYTHONPATH and SDP_JOBS_DIR unset:
   `NEW/bin/python -m sdp_jupyter.doctor --json` must report no FAIL and name the wheel's copy of the
   package and its engine; `NEW/bin/sdp-train --nodes 2 --backend smddp train.py` (the console script
   the wheel installed) must run both ranks, whose all_reduce on the engine sums to 3, in a job folder
   under ./sdp_jobs.
4. The wheel carries the engine's sources (sdp_jupyter/_sources/: native/, setup.py, pyproject.toml,
   README.md, the files a source package needs), so from NEW, outside the checkout, a SageMaker
   rehearsal with our engine (--engine sdp on ml.g5.12xlarge, the local moto stand-in for AWS) ships a
   source package written from them, which installs and builds in the rehearsal's fresh image, and
   both hosts all_reduce on that engine (about a minute more: the engine is compiled again).
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
OWN = re.compile(r"(__editable__[._]+)?sdp_jupyter([-_.].*)?$")  # sdp_jupyter's entries in site-packages

TRAIN = """\
import torch
import torch.distributed as dist
import sdp_jupyter._engine

dist.init_process_group("smddp")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item():g}, engine {sdp_jupyter._engine.__file__}")
dist.destroy_process_group()
"""

# The rehearsed job's cell (cell.py), and the script NEW's python runs in the working folder: a 2-host
# rehearsal with our engine through the launch API (as tests/launch/targets/sagemaker/test_sagemaker_rehearse.py
# drives it), then the stand-in closed as that module's fixture does (else the process waits on moto's server)
CELL = """\
import sys, torch, torch.distributed as dist, sdp_jupyter, sdp_jupyter._engine
dist.init_process_group("smddp")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
{"sum": t.item(), "world": dist.get_world_size(), "engine": sdp_jupyter._engine.__file__, "prefix": sys.prefix}
"""
REHEARSE = """\
import json
from pathlib import Path
from sdp_jupyter.launch import JobSpec, launch
from sdp_jupyter.launch.targets.sagemaker.source import source_tree
from sdp_jupyter.testing import sagemaker_standin

job = launch(JobSpec(code=Path("cell.py").read_text(), name="wheel-rehearsal", target="sagemaker", nodes=2,
                     procs_per_node=1, backend="smddp", jobs_dir="sdp_jobs", sagemaker={"rehearse": True,
                     "engine": "sdp", "instance_type": "ml.g5.12xlarge", "inputs": [], "poll_interval": 0.2}))
state = job.wait(240)
print(json.dumps({"state": state, "error": job.error, "sources": str(source_tree()), "engine_ran":
                  job.sagemaker.get("engine_ran"), "result": job.result() if state == "succeeded" else None,
                  "logs": job.logs(0)[-3000:] + job.logs(1)[-3000:]}))
sagemaker_standin.shared().close()
"""


def checkout_files() -> list[str]:
    """The checkout's files as a clone with the work in progress has them: tracked and not deleted,
    and untracked ones that git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return [f for f in listed if f and (ROOT / f).is_file()]


def engine_sources() -> set[str]:
    """The checkout's files a source package needs besides the package (source.py's lists), by path."""
    from sdp_jupyter.launch.targets.sagemaker import source

    native = {p.relative_to(ROOT).as_posix() for p in (ROOT / "native").rglob("*")
              if p.is_file() and p.suffix in source._NATIVE_FILES}
    return native | set(source._SDIST_TOP)


def build_wheel(dest: Path) -> Path:
    """The wheel of a copy of the checkout, built in `dest`: see the module docstring (1)."""
    src = dest / "src"
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env = {**os.environ, "SDP_BUILD_QUICK": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--skip-dependency-check",
                          "--outdir", str(dest / "wheels"), "."], cwd=src, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"python -m build failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    wheels, sdists = (sorted((dest / "wheels").glob(f"sdp_jupyter-*.{ext}")) for ext in ("whl", "tar.gz"))
    assert len(wheels) == 1 and len(sdists) == 1, (wheels, sdists)
    with tarfile.open(sdists[0]) as tar:  # the wheel was built from it: it has what builds the engine
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert engine_sources() <= names, sorted(engine_sources() - names)
    return wheels[0]


def user_env(wheel: Path, dest: Path) -> Path:
    """A fresh virtual environment at `dest` with the wheel installed and this environment's other
    packages visible: see the module docstring (2). Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    python = dest / "bin" / "python"
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"pip install failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_path("purelib")).iterdir():  # the packages the user already had
        if not OWN.match(entry.name) and not (site / entry.name).exists():
            (site / entry.name).symlink_to(entry)
    return python


def user_run(args: list, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """`args` run as the user would: in `cwd`, without the suite's PYTHONPATH, jobs folder or venv."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "SDP_JOBS_DIR", "VIRTUAL_ENV", "PYTEST_CURRENT_TEST")}
    return subprocess.run([str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The python of a fresh environment that has sdp_jupyter from its wheel."""
    base = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(base)
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"sdp_jupyter/_engine\..*\.so", n) for n in names), "the wheel has no engine"
    sources = {n.removeprefix("sdp_jupyter/_sources/") for n in names if n.startswith("sdp_jupyter/_sources/")}
    assert sources == engine_sources(), "the wheel's sdp_jupyter/_sources/ is not the engine's sources"
    return user_env(wheel, base / "venv")


@pytest.fixture
def workdir(tmp_path) -> Path:
    """A working folder outside the checkout."""
    assert not tmp_path.resolve().is_relative_to(ROOT)
    return tmp_path


def test_the_doctor_passes_on_the_wheel(installed, workdir):
    run = user_run([installed, "-m", "sdp_jupyter.doctor", "--json"], workdir, timeout=180)
    report = json.loads(run.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert run.returncode == 0 and not report["failed"], \
        "\n".join(f"{c['status']} {c['name']}: {c['detail']}" for c in report["checks"]) + run.stderr[-2000:]
    site = str(installed.parent.parent / "lib")
    package = checks["sdp_jupyter"]["detail"]
    assert site in package and package.endswith(", installed"), package  # the wheel's copy, not the checkout
    assert site in checks["engine"]["detail"], checks["engine"]["detail"]
    assert checks["smddp backend"]["status"] == "OK", checks["smddp backend"]


def test_a_two_node_smddp_job_runs_from_the_wheel(installed, workdir):
    (workdir / "train.py").write_text(TRAIN)
    run = user_run([installed.parent / "sdp-train", "--nodes", "2", "--backend", "smddp", "--ranks-output", "all",
                    "--name", "from-the-wheel", "train.py"], workdir, timeout=180)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    engine = str(installed.parent.parent / "lib")
    for rank in (0, 1):
        line = next((s for s in run.stdout.splitlines() if s.startswith(f"[rank {rank}] rank {rank} of 2: sum 3,")),
                    None)
        assert line and engine in line, run.stdout[-3000:]
    assert "Job from-the-wheel: succeeded" in run.stderr and "backend smddp" in run.stderr, run.stderr[-3000:]
    status = json.loads((workdir / "sdp_jobs" / "from-the-wheel" / "status.json").read_text())
    assert status["state"] == "succeeded", status


@pytest.mark.skipif(importlib.util.find_spec("moto") is None or importlib.util.find_spec("sagemaker") is None,
                    reason="a rehearsal needs sdp_jupyter[rehearse]")
def test_a_sagemaker_rehearsal_with_our_engine_runs_from_the_wheel(installed, workdir):
    (workdir / "cell.py").write_text(CELL)
    run = user_run([installed, "-c", REHEARSE], workdir, timeout=360)
    assert run.returncode == 0 and run.stdout.strip(), run.stdout[-3000:] + run.stderr[-3000:]
    report = json.loads(run.stdout.strip().splitlines()[-1])
    site = str(installed.parent.parent / "lib")
    assert report["sources"].startswith(site) and report["sources"].endswith("sdp_jupyter/_sources"), report
    assert report["state"] == "succeeded", f"{report['error']}\n{report['logs']}"
    result = report["result"]
    assert (result["sum"], result["world"]) == (3.0, 2), result
    # the hosts built the engine from the shipped package in the image's own environment, not NEW's
    assert result["engine"].startswith(result["prefix"]) and not result["engine"].startswith(site), result
    assert report["engine_ran"].startswith("sdp_jupyter's engine") and "built from sdp_jupyter-" in report["logs"], \
        report
