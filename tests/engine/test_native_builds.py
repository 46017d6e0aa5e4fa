"""The engine built other ways, each running the engine's own tests (issue 11: sanitizers;
issue 12: a portable build with no intrinsics; issue 33: clang and a statically linked C++ runtime,
which must export nothing but the module init and run torch's collectives after `import torch`)."""
from __future__ import annotations

import shutil
import subprocess

import pytest

from helpers.native_builds import build_variant, run_pytest

pytestmark = pytest.mark.slow

# What the sanitized engine runs: every collective, dtype and layout check, the failure tests,
# the hardening scenarios and the fuzzers (bounded by SDP_FUZZ_SECONDS).
ENGINE_TESTS = ["engine/test_engine.py", "engine/test_hardening.py", "engine/test_fuzz.py"]


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
           "SDP_TEST_MISMATCH_SECONDS": "5", "SDP_FUZZ_SECONDS": "4"}
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
    p = run_pytest(root, ["engine/test_engine.py", "-k", "kernels_match or every_collective or bf16 or mismatch"], timeout=600)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]


# ---- issue 33: the engine beside torch's libstdc++, whatever the toolchain -------------------
# tools/build_matrix.py builds and checks the engine four ways; these tests run its functions on
# two of them. Each variant is built once per session, whichever test asks first.

@pytest.fixture(scope="module")
def matrix_build():
    from tools import build_matrix

    built: dict = {}

    def get(name: str):
        if name not in built:
            variant = build_matrix.VARIANTS[name]
            why = build_matrix.missing(variant)
            try:
                built[name] = ("skip", why) if why else ("ok", build_matrix.build(variant))
            except RuntimeError as exc:  # kept: a second test does not build it again
                built[name] = ("fail", str(exc))
        state, value = built[name]
        if state == "skip":
            pytest.skip(f"the {name} build needs {value}")
        if state == "fail":
            pytest.fail(value)
        return value

    return get


def _exports_problems(path: str) -> list[str]:
    """What is wrong with the dynamic symbols of the engine at `path` (nothing: []); read with
    sdp_jupyter/_native_check.py and, where binutils are installed, with nm."""
    from sdp_jupyter._native_check import inspect

    report = inspect(path)
    problems = []
    if report.exported_std:
        problems.append(f"{len(report.exported_std)} std:: symbols exported, e.g. {report.exported_std[:3]}")
    if report.exported != ["PyInit__engine"]:
        problems.append(f"{len(report.exported)} symbols exported, not just PyInit__engine: {report.exported[:8]}")
    nm = shutil.which("nm")
    if nm:
        out = subprocess.run([nm, "-D", "--defined-only", path], capture_output=True, text=True, check=True).stdout
        names = sorted(ln.split()[-1] for ln in out.splitlines() if len(ln.split()) == 3)
        if names != ["PyInit__engine"]:
            std = subprocess.run([nm, "-D", "-C", "--defined-only", path], capture_output=True, text=True).stdout
            problems.append(f"nm -D --defined-only lists {len(names)} symbols "
                            f"({sum('std::' in ln for ln in std.splitlines())} with std::), e.g. {names[:8]}")
        if bool(report.exported) != bool(names):
            problems.append(f"_native_check and nm disagree: {report.exported[:5]} vs {names[:5]}")
    return problems


def test_default_and_static_runtime_builds_export_only_the_module_init(matrix_build):
    from sdp_jupyter._native_check import engine_path, inspect
    from tools.build_matrix import engine_of

    static = str(engine_of(matrix_build("static-runtime")))
    assert not inspect(static).cxx_runtime_dynamic, \
        f"LDFLAGS=-static-libstdc++ gave a shared C++ runtime ({inspect(static).needed}): nothing is checked"
    problems = {what: _exports_problems(path) for what, path in
                [("default (installed) " + engine_path(), engine_path()), ("static-runtime " + static, static)]}
    assert not any(problems.values()), "\n".join(f"{what}: {p}" for what, ps in problems.items() for p in ps)


@pytest.mark.parametrize("name", ["static-runtime", "clang"])
def test_build_runs_engine_tests_and_torch_collectives_after_import_torch(name, matrix_build):
    """The matrix's --fast row: exports, the engine tests' selection, and 2 ranks that import torch
    (and so the system libstdc++.so.6) first, then all_reduce, DDP against gloo and send/recv."""
    from tools.build_matrix import VARIANTS, Row, check_built

    root = matrix_build(name)
    row = check_built(Row(name, VARIANTS[name].env), root, fast=True)
    assert row.status == "passed", row.reason
    for rank in row.smoke_details["ranks"]:
        assert rank["value"]["cxx_runtime_before"], rank["value"]  # torch's libstdc++ was there first
