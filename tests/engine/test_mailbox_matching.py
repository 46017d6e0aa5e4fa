"""The mailbox's matching rules without a socket (issue 28): native/tests/test_matching.cpp drives
sdp::Matcher (native/include/sdp/matching.h) alone, built from matching.cpp and nothing else of the
engine, with the compiler setup.py uses. One pytest case per C++ case; a failed check prints its
line. The same rules through real sockets: test_torch_backend.py's message tests."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "native" / "tests" / "test_matching.cpp"
CASES = re.findall(r"^\s*CASE\((\w+)\),", SOURCE.read_text(), flags=re.M)


def _compiler() -> list[str]:
    # setuptools' choice: $CXX, else the compiler Python was built with.
    return shlex.split(os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++")


@pytest.fixture(scope="module")
def matching_binary(tmp_path_factory) -> Path:
    cxx = _compiler()
    if not shutil.which(cxx[0]):
        pytest.skip(f"no C++ compiler ({cxx[0]}) to build the matching tests")
    out = tmp_path_factory.mktemp("matching") / "test_matching"
    cmd = cxx + ["-std=c++17", "-O1", "-Wall", f"-I{ROOT / 'native' / 'include'}", str(SOURCE),
                 str(ROOT / "native" / "src" / "matching.cpp"), "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, " ".join(cmd) + "\n" + p.stderr[-4000:]
    return out


def test_every_case_of_the_program_is_in_its_table():
    defined = re.findall(r"^void (\w+)\(\) \{", SOURCE.read_text(), flags=re.M)
    assert len(CASES) >= 20 and sorted(defined) == sorted(CASES), "a case function is missing from kCases"


@pytest.mark.parametrize("case", CASES)
def test_matching(matching_binary, case):
    p = subprocess.run([str(matching_binary), case], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.strip() == f"ok   {case}", p.stdout
