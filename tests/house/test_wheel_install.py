"""A user who installs sdp_jupyter from a wheel into an environment of their own, with no dev.sh and no
checkout on the path, can run the doctor and a 2-node job.

What the test does, once per module (about two minutes, most of it compiling the engine):

1. The wheel: the checkout's files (tracked, and untracked ones git does not ignore, as a clone with
   the work in progress would have them; never build/, .venv/ or an engine built earlier) are copied to
   a temporary folder and built there with `pip wheel . --no-deps -w DIR`, as install.md tells users.
   Two departures from a user's build, both for speed and to need no network: `--no-build-isolation`
   (setuptools, wheel and pybind11 come from the running environment instead of being downloaded into
   a fresh build environment) and SDP_BUILD_QUICK=1 (the engine at -O0: it builds in a third of the
   time; the code is the same).
2. The user's environment, with torch "already there": `python -m venv --without-pip NEW`, then this
   environment's pip installs the wheel into it (`pip --python NEW/bin/python install --no-deps
   --no-index WHEEL`: NEW is still empty, so pip sees no other sdp_jupyter). Only then NEW is given the
   packages a user would already have (torch, numpy and the wheel's other dependencies): a folder of
   links to every entry of this environment's site-packages except sdp_jupyter's own (its editable
   install and metadata), added to NEW by a .pth line `import site; site.addsitedir(FOLDER)`, which
   makes it a site folder like NEW's own (its .pth files are read), after NEW's. Copying torch (GiBs)
   or downloading it would take minutes; links take milliseconds, and NEW can import sdp_jupyter only
   from the wheel.
3. From a working folder outside the checkout, with PYTHONPATH and SDP_JOBS_DIR unset:
   `NEW/bin/python -m sdp_jupyter.doctor --json` must report no FAIL and name the wheel's copy of the
   package and its engine; `NEW/bin/sdp-train --nodes 2 --backend smddp train.py` (the console script
   the wheel installed) must run both ranks, whose all_reduce on the engine sums to 3, in a job folder
   under ./sdp_jobs.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
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


def checkout_files() -> list[str]:
    """The checkout's files as a clone with the work in progress has them: tracked and not deleted,
    and untracked ones that git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split("\0")
    return [f for f in listed if f and (ROOT / f).is_file()]


def build_wheel(dest: Path) -> Path:
    """The wheel of a copy of the checkout, built in `dest`: see the module docstring (1)."""
    src = dest / "src"
    for f in checkout_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    env = {**os.environ, "SDP_BUILD_QUICK": "1"}
    env.pop("PYTHONPATH", None)
    run = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation",
                          "-w", str(dest / "wheels")], cwd=src, env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, f"pip wheel failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    wheels = sorted((dest / "wheels").glob("sdp_jupyter-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def user_env(wheel: Path, dest: Path) -> Path:
    """A fresh virtual environment at `dest` with the wheel installed and this environment's other
    packages visible: see the module docstring (2). Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest)], check=True, timeout=120)
    python = dest / "bin" / "python"
    run = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                          "--no-index", str(wheel)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"pip install failed:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}"
    theirs = dest.parent / f"{dest.name}-packages"  # the packages the user already had
    theirs.mkdir()
    for entry in Path(sysconfig.get_path("purelib")).iterdir():
        if not OWN.match(entry.name):
            (theirs / entry.name).symlink_to(entry)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (Path(site) / "_already_installed.pth").write_text(f"import site; site.addsitedir({str(theirs)!r})\n")
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
    assert any(re.fullmatch(r"sdp_jupyter/_engine\..*\.so", n) for n in zipfile.ZipFile(wheel).namelist()), \
        "the wheel has no engine"
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
