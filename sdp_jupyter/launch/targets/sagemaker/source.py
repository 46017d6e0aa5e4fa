"""The source directory a SageMaker job uploads as its code channel: the cell, the container entry,
the spec, pushed variables and sdp_jupyter (a pure-Python copy, or with our engine a source package)."""
from __future__ import annotations

import gzip
import io
import secrets
import shutil
import tarfile
from pathlib import Path

import sdp_jupyter
from sdp_jupyter import jobdir
from sdp_jupyter._engine_sources import NATIVE_FILES, SOURCES_DIR, SOURCES_TOP
from sdp_jupyter.launch.options import SpecError
from sdp_jupyter.launch.targets.sagemaker.options import ENTRY_SCRIPT, SECRET_FILE, SOURCE_DIR



_PACKAGE_FILES = (".py", ".json", ".txt", ".md")
# the engine's sources: native/'s NATIVE_FILES and SOURCES_TOP, in a checkout or an installed SOURCES_DIR
_NATIVE_FILES, _SDIST_TOP = NATIVE_FILES, SOURCES_TOP


def _is_source_tree(root: Path) -> bool:
    return all((root / name).is_file() for name in _SDIST_TOP[:2]) and (root / "native").is_dir()


def source_tree() -> Path | None:
    """Where the engine's sources are (pyproject.toml, setup.py, native/): the checkout this sdp_jupyter
    runs from, else the copy an installed wheel carries in sdp_jupyter/_sources/; None for a package
    installed without them (a wheel built by a tool that skips setup.py's build_py)."""
    package = Path(sdp_jupyter.__file__).resolve().parent
    for root in (package.parent, package / SOURCES_DIR):
        if _is_source_tree(root):
            return root
    return None


def no_sources_error() -> SpecError:
    return SpecError("--engine", f"sdp ships sdp_jupyter's C++ sources with the job, and this sdp_jupyter "
                                 f"({Path(sdp_jupyter.__file__).parent}) is installed without them: it has no "
                                 f"{SOURCES_DIR}/ with native/, setup.py and pyproject.toml, which the wheel "
                                 "gets from setup.py's build_py (a wheel built some other way, or a copy of "
                                 "the package without that folder). Fix: reinstall it from a checkout or its "
                                 "sdist with pip (pip install ., or pip install the wheel that python -m build "
                                 "or pip wheel writes), or --engine aws on ml.p4d.24xlarge / ml.p4de.24xlarge")


def _package_files(package: Path):
    for path in sorted(package.rglob("*")):
        rel = path.relative_to(package)
        if path.is_file() and path.suffix in _PACKAGE_FILES and not {"__pycache__", SOURCES_DIR} & set(rel.parts):
            yield path, rel


def build_sdist(dest_dir: Path) -> Path:
    """sdp_jupyter as a source package (``sdp_jupyter-<version>.tar.gz`` in `dest_dir`): pyproject.toml,
    setup.py, native/ (from source_tree(): the checkout, or an installed wheel's copy) and the package's
    Python and data files, what `pip install` needs to build the engine. Written here rather than by
    `python -m build`: no build tool, no egg-info left in the checkout, and it takes a fraction of a
    second."""
    root = source_tree()
    if root is None:
        raise no_sources_error()
    version = sdp_jupyter.__version__
    base = f"sdp_jupyter-{version}"
    target = Path(dest_dir) / f"{base}.tar.gz"
    files = [(root / name, name) for name in _SDIST_TOP if (root / name).is_file()]
    files += [(p, p.relative_to(root).as_posix()) for p in sorted((root / "native").rglob("*"))
              if p.is_file() and p.suffix in _NATIVE_FILES]
    package = Path(sdp_jupyter.__file__).resolve().parent
    files += [(p, f"sdp_jupyter/{rel.as_posix()}") for p, rel in _package_files(package)]
    pkg_info = f"Metadata-Version: 2.1\nName: sdp_jupyter\nVersion: {version}\n".encode()
    # the same sources give the same bytes (no time stamps but the files'), so a host that installed
    # this package already (a rehearsal's reused image) knows it by its digest
    with open(target, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo(f"{base}/PKG-INFO")
        info.size, info.mode = len(pkg_info), 0o644
        info.mtime = max(int(p.stat().st_mtime) for p, _ in files)
        tar.addfile(info, io.BytesIO(pkg_info))
        for path, arcname in files:
            tar.add(str(path), arcname=f"{base}/{arcname}", recursive=False, filter=_plain_member)
    return target


def _plain_member(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def build_source_dir(job_dir: Path, plan) -> Path:
    """The code channel of `plan` (plan.py's Plan, which imports this module): script.py, sdp_entry.py, spec.json, push.pkl, requirements.txt, and
    sdp_jupyter: its pure-Python files as sdp_jupyter/ (SageMaker's smddp, gloo, nccl), or with our
    engine (plan.engine "sdp") a source package the entry installs, compiling the engine."""
    src = job_dir / SOURCE_DIR
    if src.exists():
        shutil.rmtree(src)
    src.mkdir(parents=True)
    shutil.copy2(job_dir / jobdir.SCRIPT, src / jobdir.SCRIPT)
    shutil.copy2(Path(__file__).parent / "entry.py", src / ENTRY_SCRIPT)
    (src / jobdir.SPEC).write_text(plan.spec.to_json())
    if (job_dir / jobdir.PUSH).is_file():
        shutil.copy2(job_dir / jobdir.PUSH, src / jobdir.PUSH)
    (src / "requirements.txt").write_text(
        "# Installed by SageMaker before the job starts (pip install -r requirements.txt).\n"
        "# sdp_jupyter's worker side needs nothing beyond the PyTorch training image.\n")
    if plan.engine == "sdp":
        build_sdist(src)
        # our engine authenticates the job's ranks with a secret: one per job, in the code channel
        # (the bucket's readers could read the code too), never in the request's Environment, which
        # DescribeTrainingJob shows (docs/security.md)
        jobdir.write_private(src / SECRET_FILE, secrets.token_hex(32).encode())
        return src
    for path, rel in _package_files(Path(sdp_jupyter.__file__).resolve().parent):
        dest = src / "sdp_jupyter" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, dest)
    return src
