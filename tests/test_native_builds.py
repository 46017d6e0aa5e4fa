"""The engine built two other ways, each running the engine's own tests (issue 11: sanitizers;
issue 12: a portable build with no intrinsics)."""
from __future__ import annotations

import subprocess

import pytest

from helpers.native_builds import build_variant, run_pytest

pytestmark = pytest.mark.slow

# What the sanitized engine runs: every collective, dtype and layout check, the failure tests,
# the hardening scenarios and the fuzzers (bounded by SDP_FUZZ_SECONDS).
ENGINE_TESTS = ["test_engine.py", "test_hardening.py", "test_fuzz.py"]


def _preload() -> str:
    """ASan's runtime must come first in a process whose executable (python) is not C++; libstdc++
    right after it, or ASan cannot find the real __cxa_throw and aborts on the first C++ throw."""
    lib = lambda name: subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True,  # noqa: E731
                                      text=True).stdout.strip()
    return f"{lib('libasan.so')} {lib('libstdc++.so')}"


def test_engine_under_address_and_undefined_behaviour_sanitizers():
    root = build_variant("sanitize", {"SDP_SANITIZE": "1"})
    env = {"LD_PRELOAD": _preload(),
           # Python itself leaks by design at exit; everything else must be clean.
           "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
           "SDP_TEST_MISMATCH_SECONDS": "8", "SDP_FUZZ_SECONDS": "6"}
    p = run_pytest(root, ENGINE_TESTS + ["-k", "not large and not kernels_match"], env=env, timeout=900)
    report = p.stdout[-4000:] + p.stderr[-4000:]
    assert p.returncode == 0, report
    assert "ERROR: AddressSanitizer" not in report and "runtime error:" not in report, report


def test_portable_build_without_intrinsics():
    root = build_variant("portable", {"SDP_PORTABLE": "1"})
    import sys

    check = subprocess.run([sys.executable, "-c", "from sdp_jupyter import _engine; print(_engine.kernel_isa())"],
                           capture_output=True, text=True, env={"PYTHONPATH": str(root)}, cwd=str(root))
    assert check.stdout.strip() == "portable", check.stderr
    p = run_pytest(root, ["test_engine.py", "-k", "kernels_match or every_collective or bf16 or mismatch"], timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
