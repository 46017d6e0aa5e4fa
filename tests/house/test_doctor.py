"""`python -m sdp_jupyter.doctor` (issue 33 item 5): the report on this machine, its JSON and exit
status, the FAIL and WARN lines a broken engine, a small /dev/shm, a crashing or hanging smoke run
give, and %sdp_doctor."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from sdp_jupyter import _native_check, doctor
from sdp_jupyter.doctor import FAIL, INFO, OK, STATUSES, WARN, Check, Report, summary_line

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    return doctor.collect(smoke=True)


def by_name(report: Report, name: str) -> Check:
    return next(c for c in report.checks if c.name == name)


def test_the_report_on_this_machine(report):
    names = [c.name for c in report.checks]
    for expected in ("platform", "python", "torch", "smddp backend", "numpy", "sdp_jupyter", "engine", "/dev/shm",
                     "peer memory reads", "NVML", "smoke all_reduce (cpu)"):
        assert expected in names, (expected, names)
    for c in report.checks:
        assert c.status in STATUSES and c.detail, c
        if c.status in (WARN, FAIL):
            assert c.fix, f"{c.name} is {c.status} without a fix"
    assert not report.failed, report.text()
    engine = by_name(report, "engine")
    assert engine.status == OK, engine
    assert "1 exported symbol(s), 0 of them std::" in engine.detail
    native = _native_check.inspect(_native_check.engine_path())
    if "libstdc++.so.6" in native.needed:  # here (Debian's g++); a GCC that links the runtime statically
        assert "shared libstdc++, 1 exported" in engine.detail  # says "static C++ runtime kept private"
    assert "kernels avx2+f16c" in engine.detail or "kernels portable" in engine.detail
    smoke = by_name(report, "smoke all_reduce (cpu)")
    assert smoke.status == OK and "equal to gloo's" in smoke.detail, smoke
    assert by_name(report, "sdp_jupyter").detail.startswith(f"0.1.0 at {REPO / 'sdp_jupyter'}")
    text = report.text()
    assert text.splitlines()[-1] == summary_line(report)
    assert all(line.split()[0] in STATUSES or line.lstrip().startswith("fix: ")
               for line in text.splitlines()[1:-1]), text


def test_summary_line_names_what_is_not_ok():
    r = Report([Check("platform", OK, "Linux"), Check("/dev/shm", WARN, "64 MiB free", "--shm-size", "/dev/shm 64 MiB"),
                Check("engine", FAIL, "exports std::", "rebuild"), Check("NVML", INFO, "no driver")])
    assert summary_line(r) == "doctor: 1 OK, 1 WARN (/dev/shm 64 MiB), 1 FAIL (engine), 1 INFO"
    assert summary_line(Report([Check("a", OK, "x")])) == "doctor: 1 OK, 0 WARN, 0 FAIL"
    assert Report.from_dict(json.loads(json.dumps(r.to_dict()))).checks == r.checks


def test_json_without_smoke_runs_with_no_notebook_package():
    """--json's shape and exit status 0, in a process where IPython, ipywidgets and plotly cannot be
    imported (the GPU machines have none of them)."""
    code = textwrap.dedent("""
        import sys
        for name in ("IPython", "ipywidgets", "plotly", "ipykernel", "anywidget"):
            sys.modules[name] = None  # import raises ImportError
        from sdp_jupyter import doctor
        sys.exit(doctor.main(["--json", "--no-smoke"]))
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stdout + p.stderr
    data = json.loads(p.stdout)
    assert set(data) == {"checks", "counts", "failed", "summary"}
    assert data["failed"] is False and set(data["counts"]) == set(STATUSES)
    for c in data["checks"]:
        assert set(c) == {"name", "status", "detail", "fix", "brief"} and c["status"] in STATUSES
    smoke = next(c for c in data["checks"] if c["name"] == "smoke all_reduce")
    assert smoke["status"] == INFO and "--no-smoke" in smoke["detail"]
    assert data["summary"].startswith("doctor: ") and " 0 FAIL" in data["summary"]


def bad_engine(path: str) -> _native_check.NativeReport:
    return _native_check.NativeReport(path, needed=["libm.so.6", "libc.so.6"],
                                      exported=["PyInit__engine", "_ZNSt6locale7classicEv", "_ZSt4cout"])


def test_an_engine_that_exports_std_symbols_fails_with_the_fix_and_exit_status_1(monkeypatch, capsys):
    monkeypatch.setattr(_native_check, "inspect", bad_engine)
    r = Report()
    doctor.check_engine(r)
    (engine,) = r.checks
    assert engine.status == FAIL
    assert "static C++ runtime kept private, 3 exported symbol(s), 2 of them std::" in engine.detail
    assert "exports 2 std:: symbols" in engine.fix and "CC=gcc CXX=g++" in engine.fix
    assert doctor.main([]) == 1  # the smoke is not run on an engine known to crash
    out = capsys.readouterr().out
    assert "FAIL  engine" in out and "fix: " in out
    assert out.splitlines()[-1].startswith("doctor: ") and "1 FAIL (engine exports std:: symbols)" in out
    assert "not run: torch or the engine failed above" in out


def test_an_engine_that_cannot_be_imported_fails_with_how_to_build_it(monkeypatch):
    import sdp_jupyter

    monkeypatch.delattr(sdp_jupyter, "_engine", raising=False)
    monkeypatch.setitem(sys.modules, "sdp_jupyter._engine", None)
    r = Report()
    doctor.check_engine(r)
    (engine,) = r.checks
    assert engine.status == FAIL and "cannot import sdp_jupyter._engine" in engine.detail
    assert "C++17 compiler" in engine.fix and "pip install -e ." in engine.fix


def test_a_bad_sdp_no_simd_fails_naming_the_variable(monkeypatch):
    monkeypatch.setenv("SDP_NO_SIMD", "maybe")  # the engine refuses it when a group starts: so does the doctor
    r = Report()
    doctor.check_engine(r)
    (engine,) = r.checks
    assert engine.status == FAIL and "SDP_NO_SIMD='maybe' is not a boolean" in engine.fix, engine
    monkeypatch.setenv("SDP_NO_SIMD", "off")
    r = Report()
    doctor.check_engine(r)
    assert r.checks[0].status != FAIL


class _Statvfs:
    def __init__(self, total, free):
        self.f_frsize, self.f_blocks, self.f_bavail = 4096, total // 4096, free // 4096


def test_a_small_dev_shm_warns_with_the_docker_fix(monkeypatch):
    real = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: _Statvfs(64 << 20, 64 << 20) if str(p) == "/dev/shm" else real(p))
    r = Report()
    doctor.check_shm(r)
    (shm,) = r.checks
    assert shm.status == WARN and shm.detail == "writable, 64 MiB free of 64 MiB"
    assert "--shm-size" in shm.fix and shm.brief == "/dev/shm 64 MiB"
    monkeypatch.setattr(os, "statvfs", lambda p: _Statvfs(8 << 30, 6 << 30) if str(p) == "/dev/shm" else real(p))
    r = Report()
    doctor.check_shm(r)
    assert r.checks[0].status == OK and r.checks[0].detail == "writable, 6.0 GiB free of 8.0 GiB"


def test_a_missing_dev_shm_fails(tmp_path):
    r = Report()
    doctor.check_shm(r, str(tmp_path / "no-shm"))
    assert r.checks[0].status == FAIL and "does not exist" in r.checks[0].detail


@pytest.mark.parametrize("scope, status", [(1, INFO), (2, WARN), (3, WARN)])
def test_a_refused_peer_read_says_what_the_engine_does_instead(monkeypatch, tmp_path, scope, status):
    (tmp_path / "ptrace_scope").write_text(f"{scope}\n")
    monkeypatch.setattr(doctor.checks, "_probe_peer_read", lambda: (False, "Operation not permitted"))
    r = Report()
    doctor.check_peer_reads(r, str(tmp_path / "ptrace_scope"))
    (line,) = r.checks
    assert line.status == status and f"Yama ptrace_scope {scope}" in line.detail
    assert "shared-memory slots" in line.detail and "all_reduce" in line.detail
    assert "SDP_NO_CMA=1" in line.fix


def test_the_peer_read_probe_answers_on_this_machine():
    ok, why = doctor.checks._probe_peer_read()
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    if not scope.exists() or scope.read_text().strip() == "0":
        assert ok, why


def _cleanup(check: Check) -> None:
    where = check.detail.split("output in ", 1)[1].split("/rank0.log")[0]
    assert (Path(where) / "rank0.log").exists()
    shutil.rmtree(where)


def test_a_crashing_smoke_run_is_a_fail_naming_the_signal(monkeypatch):
    monkeypatch.setattr(doctor.smoke, "_SMOKE", "import os, signal, sys\nif sys.argv[1] == '1':\n"
                                          "    os.kill(os.getpid(), signal.SIGSEGV)\n")
    check = doctor.run_smoke("cpu", timeout=30)
    assert check.status == FAIL and "rank 1 killed by SIGSEGV" in check.detail, check
    assert "two C++ runtimes" in check.fix and check.brief == "smoke cpu SIGSEGV"
    _cleanup(check)


def test_a_hanging_smoke_run_is_killed_and_reported(monkeypatch):
    monkeypatch.setattr(doctor.smoke, "_SMOKE", "import time\ntime.sleep(120)\n")
    check = doctor.run_smoke("cpu", timeout=1.5)
    assert check.status == FAIL and "did not finish within 1.5 s" in check.detail, check
    assert "rank(s) 0, 1" in check.detail
    _cleanup(check)


def test_the_magic_shows_the_report(capsys):
    pytest.importorskip("IPython")  # the GPU machines have none
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()
    ip.run_line_magic("load_ext", "sdp_jupyter")
    assert "--no-smoke" in ip.find_line_magic("sdp_doctor").__doc__
    ip.run_line_magic("sdp_doctor", "--no-smoke")
    out = capsys.readouterr().out
    assert out.startswith("sdp_jupyter doctor: paste this into a bug report")
    assert "OK    engine" in out and "skipped (--no-smoke)" in out
    assert out.rstrip().splitlines()[-1].startswith("doctor: ")
