"""Other builds of the engine (sanitizers, no intrinsics), each made once per test session into
build/variants/<name>, next to a copy of the Python package, so a test run can put it first on
PYTHONPATH (and tests/helpers/ranks.py gives it to the ranks through SDP_TEST_PACKAGE_ROOT)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def build_variant(name: str, env: dict) -> Path:
    """Build the engine with `env` (e.g. {"SDP_SANITIZE": "1"}) and return a folder holding a
    sdp_jupyter package that uses it. Raises RuntimeError with the compiler's output on failure."""
    root = REPO / "build" / "variants" / name
    pkg = root / "sdp_jupyter"
    if pkg.exists():
        shutil.rmtree(pkg)
    shutil.copytree(REPO / "sdp_jupyter", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    p = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(root / "lib"),
                        "--build-temp", str(root / "tmp"), "--force"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, **env}, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"building the {name} engine failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    built = list((root / "lib" / "sdp_jupyter").glob("_engine*.so"))
    if not built:
        raise RuntimeError(f"building the {name} engine made no extension:\n{p.stdout[-2000:]}")
    shutil.copy2(built[0], pkg / built[0].name)
    return root


def run_pytest(root: Path, args: list[str], env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run pytest on the repository's tests with the variant package first on the path."""
    e = dict(os.environ)
    e.pop("PYTEST_CURRENT_TEST", None)
    e.update({"PYTHONPATH": os.pathsep.join([str(root), e.get("PYTHONPATH", "")]),
              "SDP_TEST_PACKAGE_ROOT": str(root)})
    e.update(env or {})
    # -o pythonpath=: pyproject's pythonpath (the checkout) would put the installed engine ahead of
    # the variant's in pytest's own process (its in-process kernel tests tested the wrong build).
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-o", "pythonpath=",
                           *args],
                          cwd=REPO / "tests", capture_output=True, text=True, env=e, timeout=timeout)
